"""Next tokens from float32 logits, in vLLM's order (vllm/v1/sample/sampler.py): penalties (repetition,
frequency, presence), then greedy argmax at temperature 0, else temperature, min_p, top-k, top-p and a
draw from the request's own seeded generator (or the engine's). Logprobs are vLLM's default
("raw_logprobs"): log_softmax of the logits as the model gave them, before penalties and filters.
Nothing here waits for the GPU: tokens and logprobs stay on the device until the caller reads them.

Robust by construction, since one request's numbers must not hurt the others (on a GPU an invalid
distribution is a device-side assert that ends the process, so catching exceptions cannot do): for any
values SamplingParams accepts and any logits, ±inf and NaN included, every row gets a token id in the
vocabulary and torch.multinomial only sees rows that are finite, non-negative and of positive sum. Per row:
- NaN (from the model) excludes its token;
- a factor beyond float32's range (a repetition_penalty or temperature like 1e-320 or 1e308) counts as
  float32's nearest positive value, so that it is neither 0 nor inf (0 x inf would be NaN);
- +inf (from the model, or a logit that overflows when penalized or divided by the temperature) makes its
  token one of the row's only candidates, tied as the likeliest: greedy takes the first, sampling draws
  among them as among equal logits (uniformly, unless top_p keeps fewer);
- a row left without a candidate (nothing but -inf and NaN) takes the fallback token: the argmax of the
  model's raw logits, NaN excluded (token 0 where every raw logit is NaN or -inf);
- a NaN logprob (a row with NaN or +inf logits) reads -inf.
A row in which no value and no factor leaves float32's finite range is computed exactly as without these
rules, bit for bit; the rules are device ops on every row, never a branch on device values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..forward_batch import to_device
from .sequence import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one request's draws; any int64 seed (negative ones too) is accepted."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@dataclass(frozen=True)
class TokenHistory:
    """The token counts of a batch's penalized rows, gathered on the device (TokenCounts.history)."""

    rows: list[int]  # the batch rows that have penalties
    index: torch.Tensor  # int64 [m]: the same rows on the device
    slots: torch.Tensor  # int64 [m]: their rows of TokenCounts
    output_counts: torch.Tensor  # int32 [m, vocab]: how often each token is in the output so far
    prompt_mask: torch.Tensor  # bool [m, vocab]: whether each token is in the prompt


class TokenCounts:
    """Token counts of the sequences that use penalties, on the device: a row per such sequence of one
    pool (int32 counts of its output tokens, a bool mask of its prompt's), assigned at its first sample,
    advanced on the device by each sampled token (`record`, so pending tokens count at once) and freed
    when it finishes. The pool grows by doubling; sequences without penalties take no row."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free: list[int] = []

    @property
    def num_assigned(self) -> int:
        return self.output.shape[0] - len(self._free)

    def assign(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> int:
        """A row holding this history; give it back with `release`."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        try:
            self.prompt[row].zero_()
            self.prompt[row].index_fill_(0, to_device(list(prompt_token_ids), torch.int64, self.device), True)
            self.output[row].zero_()
            if output_token_ids:
                ids = to_device(list(output_token_ids), torch.int64, self.device)
                self.output[row].index_add_(0, ids, torch.ones(len(ids), dtype=torch.int32, device=self.device))
        except BaseException:
            self._free.append(row)  # the request fails alone (LLMEngine._sample); the row stays in the pool
            raise
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def history(self, rows: list[int], slots: list[int]) -> TokenHistory:
        """The counts of pool rows `slots`, for batch rows `rows`."""
        index = to_device(slots, torch.int64, self.device)
        return TokenHistory(rows, to_device(rows, torch.int64, self.device), index,
                            self.output.index_select(0, index), self.prompt.index_select(0, index))

    def record(self, history: TokenHistory, tokens: torch.Tensor) -> None:
        """Count each penalized row's sampled token (tokens: int64 [batch rows] on the device)."""
        ones = torch.ones(len(history.rows), dtype=torch.int32, device=self.device)
        self.output.index_put_((history.slots, tokens.index_select(0, history.index)), ones, accumulate=True)

    def _grow(self) -> None:
        n = self.output.shape[0]
        size = max(8, 2 * n)
        for name in ("output", "prompt"):
            old = getattr(self, name)
            new = torch.zeros(size, self.vocab_size, dtype=old.dtype, device=self.device)
            new[:n] = old
            setattr(self, name, new)
        self._free += range(size - 1, n - 1, -1)  # lowest rows first


@dataclass(frozen=True)
class SamplerOutput:
    """A step's sampled tokens and their logprobs, all on the device."""

    tokens: torch.Tensor  # int64 [num_rows]
    logprob_rows: list[int]  # each row's row of logprob_ids / logprob_values, -1 where it asked for none
    # [rows asking, 1 + k], k the most top logprobs a row asked: the sampled token, then the top k
    logprob_ids: torch.Tensor | None = None  # int64
    logprob_values: torch.Tensor | None = None  # float32
    logprob_ranks: torch.Tensor | None = None  # int64 [rows asking]: the sampled token's rank (1: the likeliest)


class Sampler:
    """Samples one token per row of float32 logits [num_rows, vocab]."""

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.default_generator = make_generator(seed, device)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """The tokens, int64 [num_rows] on the logits' device."""
        return self.run(logits, params, generators).tokens

    def run(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
            history: TokenHistory | None = None,
            banned: tuple[list[int], list[int]] | None = None) -> SamplerOutput:
        """The tokens and, for the rows that ask, their logprobs. history: the penalized rows' token
        counts (None: no row has penalties). banned: (rows, token ids) pairs that cannot be drawn (min_tokens:
        vLLM's MinTokensLogitsProcessor, after the rows' allowed_token_ids and logit_bias, before the penalties);
        logprobs stay the raw logits'."""
        if logits.shape[0] != len(params):
            raise ValueError(f"logits: expected {len(params)} rows (one per sequence), got {logits.shape[0]}")
        logits = logits.float()
        allowed = _shaped(logits, params)
        allowed = allowed if banned is None else _without(allowed, *banned)
        fallback = _likeliest(allowed)  # the token of a row left without a candidate (module docstring)
        if history is None:
            processed, tokens = allowed, fallback.clone()
        else:
            processed = apply_penalties(allowed, history, params)
            tokens = _likeliest(processed, fallback)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = to_device(sampled, torch.int64, logits.device)
            probs = sampling_probs(processed[rows], [params[i] for i in sampled], fallback[rows])
            for j, i in enumerate(sampled):
                gen = generators[i] if generators[i] is not None else self.default_generator
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asking:
            return SamplerOutput(tokens, [-1] * len(params))
        where = [-1] * len(params)
        for j, i in enumerate(asking):
            where[i] = j
        k = max(params[i].logprobs or 0 for i in asking)
        if len(asking) == len(params):
            ids, values, ranks = token_logprobs(logits, tokens, k)
        else:
            rows = to_device(asking, torch.int64, logits.device)
            ids, values, ranks = token_logprobs(logits[rows], tokens[rows], k)
        return SamplerOutput(tokens, where, ids, values, ranks)


def _shaped(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits with each row's allowed_token_ids mask and then its logit_bias applied (a new tensor where any
    row has either), as vLLM's sampler applies them before the penalties."""
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not limited and not biased:
        return logits
    device = logits.device
    if limited:
        pairs = [(j, t) for j, i in enumerate(limited) for t in params[i].allowed_token_ids or ()]
        keep = torch.zeros(len(limited), logits.shape[1], dtype=torch.bool, device=device)
        keep[to_device([j for j, _ in pairs], torch.int64, device), to_device([t for _, t in pairs], torch.int64,
                                                                             device)] = True
        rows = to_device(limited, torch.int64, device)
        logits = logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~keep, float("-inf")))
    if biased:
        entries = [(i, t, b) for i in biased for t, b in params[i].logit_bias]
        index = (to_device([i for i, _, _ in entries], torch.int64, device),
                 to_device([t for _, t, _ in entries], torch.int64, device))
        logits = logits.index_put(index, to_device([b for _, _, b in entries], logits.dtype, device), accumulate=True)
    return logits


def _without(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """The logits (a new tensor) with each (row, token id) pair at -inf: that token cannot be drawn."""
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(token_ids, torch.int64, device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))


def apply_penalties(logits: torch.Tensor, history: TokenHistory, params: list[SamplingParams]) -> torch.Tensor:
    """The logits with the penalties of `history`'s rows applied (a new tensor), as vLLM's
    apply_penalties: repetition (tokens of the prompt or the output: positive logits divided by it,
    negative ones multiplied), then frequency (times the output count), then presence (once per
    output token)."""
    rows = [params[i] for i in history.rows]
    column = dict(dtype=logits.dtype, device=logits.device)
    repetition = _factor_column([p.repetition_penalty for p in rows], logits)
    frequency = to_device([p.frequency_penalty for p in rows], **column).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in rows], **column).unsqueeze(1)
    x = logits.index_select(0, history.index)
    counts = history.output_counts.to(logits.dtype)
    seen = history.output_counts > 0
    penalty = torch.where(history.prompt_mask | seen, repetition, 1.0)
    x = torch.where(x > 0, x / penalty, x * penalty)
    x = x - frequency * counts - presence * seen.to(logits.dtype)
    return logits.index_copy(0, history.index, x)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams],
                   fallback: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax of logits / temperature, restricted to the
    tokens at least min_p times as likely as the likeliest, then to the top-k, then to the top-p set.
    NaN excludes a token; where tokens are +inf after the temperature, the row is uniform over them; a
    row without a candidate is one-hot on its `fallback` token (int64 [rows]; None: `_likeliest(logits)`).
    Every row is finite, non-negative and of positive sum."""
    if fallback is None:
        fallback = _likeliest(logits)
    logits = _nan_excluded(logits / _factor_column([p.temperature for p in params], logits))
    top = logits == math.inf
    logits = logits.masked_fill(top.any(dim=-1, keepdim=True), -math.inf).masked_fill_(top, 0.0)
    if any(p.min_p > 0.0 for p in params):
        min_ps = to_device([p.min_p for p in params], logits.dtype, logits.device)
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    vocab = logits.shape[1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_ks) < vocab:
        ks = to_device(top_ks, torch.int64, logits.device)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_ps = to_device([p.top_p for p in params], logits.dtype, logits.device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens above it already reach top_p; the first token always stays.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps.unsqueeze(1)
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    # A row with no candidate (all -inf) gets 0 at its fallback token; the others write back what they hold.
    pick = fallback.unsqueeze(1)
    empty = logits.amax(dim=-1, keepdim=True) == -math.inf
    logits.scatter_(1, pick, logits.gather(1, pick).masked_fill(empty, 0.0))
    return logits.softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids int64, logprobs float32), each [rows, 1 + k]: column 0 the given token's, then the k most
    likely tokens' (torch.topk's order), of log_softmax(logits) (vLLM's gather_logprobs), NaN read as
    -inf (no probability; JSON has no NaN, and torch.topk would rank NaN first); and each given token's rank,
    int64 [rows]: 1 + the tokens likelier than it (vLLM's batched_count_greater_than)."""
    logprobs = _nan_excluded(logits.float().log_softmax(dim=-1))
    top = logprobs.topk(k, dim=-1)
    token_ids = token_ids.unsqueeze(1)
    own = logprobs.gather(1, token_ids)
    return (torch.cat([token_ids, top.indices], dim=1), torch.cat([own, top.values], dim=1),
            (logprobs > own).sum(dim=1) + 1)


def _nan_excluded(x: torch.Tensor) -> torch.Tensor:
    """x with NaN as -inf (a new tensor): an excluded token."""
    return torch.nan_to_num(x, nan=-math.inf, posinf=math.inf, neginf=-math.inf)


def _likeliest(logits: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's greedy token, int64 [rows]: the first index of its largest value, NaN excluded (+inf is
    the largest). A row of nothing but -inf and NaN takes `fallback`'s token (None: token 0, argmax's)."""
    x = _nan_excluded(logits)
    best = x.argmax(dim=-1)
    if fallback is None:
        return best
    return torch.where(x.gather(1, best.unsqueeze(1)).squeeze(1) == -math.inf, fallback, best)


def _factor_column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Positive factors (temperatures, repetition penalties) as a [n, 1] column of `like`'s dtype and
    device, each clamped into that dtype's positive range: beyond it one would become 0 or inf there."""
    info = torch.finfo(like.dtype)
    low = info.tiny * info.eps  # the dtype's smallest positive (subnormal) number
    return to_device([min(max(v, low), info.max) for v in values], like.dtype, like.device).unsqueeze(1)
