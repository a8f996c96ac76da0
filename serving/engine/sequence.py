"""A request inside the engine: its sampling parameters, tokens, KV blocks and progress."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detokenizer import OutputText

if TYPE_CHECKING:
    import torch

    from ..forward_batch import HostCopy

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
FINISH_REPETITION, REPETITION_DETECTED = "repetition", "repetition_detected"  # vLLM's finish and stop reasons
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a tinier one overflows
# float32 to inf, and the softmax of that is NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # the most top logprobs a token may ask for (vLLM's default --max-logprobs)
MAX_STOP_CHARS = 8192  # of all stop strings together: each is searched for after every token
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)


class BadRequest(ValueError):
    """A request the engine refuses; `param`: the request field to blame (an API's 400 names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's repetition_detection: an output ends once its last tokens are `min_count` copies of one pattern of
    `min_pattern_size` (0: 1) to `max_pattern_size` tokens (max_pattern_size 0: off)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise BadRequest(f"repetition_detection: expected 0 <= min_pattern_size <= max_pattern_size, got "
                             f"{self.min_pattern_size} and {self.max_pattern_size}", "repetition_detection")
        if self.max_pattern_size and self.min_count < 2:
            raise BadRequest(f"repetition_detection: min_count must be >= 2 with a max_pattern_size, got "
                             f"{self.min_count}", "repetition_detection")

    def found(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` end in min_count copies of one pattern of an allowed size."""
        if not self.max_pattern_size:
            return False
        n = len(token_ids)
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * self.min_count > n:
                return False
            # Each of the last `size` tokens equals the ones `size`, 2 `size`, ... before it (the first mismatch
            # stops the comparison: a token's check is short unless the output does repeat).
            if all(token_ids[n - j] == token_ids[n - j - size * m] for j in range(1, size + 1)
                   for m in range(1, self.min_count)):
                return True
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, when to stop and what to report (vLLM's fields, meanings and defaults).

    temperature 0 (< 1e-5) = greedy; top_k <= 0, top_p = 1 and min_p = 0 disable those filters; seed
    makes sampling reproducible per request. Penalties (before temperature, greedy included):
    repetition_penalty divides the positive logits and multiplies the negative ones of every token in
    the prompt or the output so far (1 = off); frequency_penalty subtracts itself times a token's count
    in the output, presence_penalty itself once for a token in the output. logprobs: the number of top
    log-probabilities per generated token (None: none), besides the token's own, which is always
    given; prompt_logprobs: the same per prompt token (the first has none). Log-probabilities are
    vLLM's default ("raw_logprobs"): log_softmax of the model's logits, before penalties and filters.
    min_tokens: no EOS (unless ignore_eos) or stop token id can be drawn before that many output tokens,
    and no stop string matches in their text; include_stop_str_in_output: the stop string (or the stop
    token's text) that ended the output stays in it; skip_special_tokens and
    spaces_between_special_tokens: how the output is detokenized (vLLM's meanings). allowed_token_ids: only
    these can be drawn (None: all); logit_bias: (token id, bias) pairs added to the logits, after the allowed
    tokens' mask and before the penalties (vLLM's order); neither changes the reported logprobs. cache_salt:
    the request's (vLLM's), mixed into its first block's hash: prefix-cache hits only among requests with the
    same salt."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    cache_salt: str | None = None  # the prefix cache shares blocks only among requests of the same salt
    repetition_detection: RepetitionDetection | None = None  # ends an output that repeats itself (vLLM's)

    def __post_init__(self) -> None:
        # vLLM's checks, field by field (SamplingParams._verify_args in vllm/sampling_params.py at
        # vllm-project/vllm@00388f6573ccfcffad607b8c9ecdf341a4669ceb), each a BadRequest naming the field;
        # NaN fails every range. Unlike vLLM: temperature has no upper bound (vLLM refuses > 2 since its
        # PR #44965; the sampler takes any finite value) and is greedy below GREEDY_TEMPERATURE (vLLM
        # raises 0 < t < 0.01 to 0.01); logprobs and prompt_logprobs stop at MAX_LOGPROBS (vLLM's -1,
        # the whole vocabulary, is refused, as vLLM's default --max-logprobs does); seed -1 is a seed.
        if self.max_tokens < 1:
            raise BadRequest(f"max_tokens: expected >= 1, got {self.max_tokens}", "max_tokens")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise BadRequest(f"temperature: expected a finite number >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p: expected in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise BadRequest(f"top_k: expected an integer >= -1 (0 or -1: all tokens), got {self.top_k!r}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p: expected in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise BadRequest(f"{name}: expected in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}", name)
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise BadRequest(f"repetition_penalty: expected a finite number > 0, got {self.repetition_penalty}",
                             "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise BadRequest(f"{name}: expected in [0, {MAX_LOGPROBS}], got {value}", name)
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise BadRequest(f"min_tokens: expected an integer in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}", "min_tokens")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise BadRequest("allowed_token_ids: expected at least one token id (null: every token)",
                             "allowed_token_ids")
        if self.cache_salt is not None and not self.cache_salt:
            raise BadRequest("cache_salt: expected a non-empty string (null: no salt)", "cache_salt")
        bad_bias = next((b for _, b in self.logit_bias if not math.isfinite(b)), None)
        if bad_bias is not None:
            raise BadRequest(f"logit_bias: expected finite biases, got {bad_bias}", "logit_bias")
        if any(not s for s in self.stop):
            raise BadRequest("stop: expected non-empty strings", "stop")
        if sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise BadRequest(f"stop: expected at most {MAX_STOP_CHARS} characters in all, got "
                             f"{sum(map(len, self.stop))}", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_vocabulary(self, vocab_size: int) -> None:
        """BadRequest naming the field of a token id outside the vocabulary [0, vocab_size)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise BadRequest(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", name)

    def banned_before_min_tokens(self, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
        """The token ids that cannot be drawn while the output is shorter than min_tokens (vLLM's
        MinTokensLogitsProcessor): the stop token ids, and EOS unless ignore_eos."""
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))))

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on: the sequence then keeps token counts on the device."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int | None = None,
                 where: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
    """The one check of a prompt, wherever requests enter (the HTTP server, LLMEngine.add_request):
    BadRequest for no tokens, a token id outside the vocabulary, or no room within max_model_len for
    max_tokens more (None: for one more; the engine ends a sequence at max_model_len; max_tokens_param:
    the request field that gave it)."""
    if not token_ids:
        raise BadRequest(f"{where}: expected at least one token", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    want = 1 if max_tokens is None else max_tokens
    if len(token_ids) + want > max_model_len:
        raise BadRequest(f"This model's maximum context length (max_model_len) is {max_model_len} tokens. However, "
                         f"you requested {len(token_ids) + want} tokens ({len(token_ids)} in the prompt, {want} in "
                         f"the completion). Please reduce the length of the prompt or the completion.",
                         "prompt" if max_tokens is None else max_tokens_param)


@dataclass(frozen=True)
class PromptLogprobsPart:
    """Prompt logprobs of one chunk, still on their way to the host: rows [lo, hi) of `copy`'s token
    ids and logprobs (HostCopy of two [rows, 1 + k] tensors: the prompt token's own, then the top k)."""

    copy: HostCopy
    lo: int
    hi: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Its tokens are prompt + output + `num_pending`; the first `num_computed_tokens` of
    them have their KV in the cache (blocks in `block_table`). After a preemption, everything is
    recomputed, less what the prefix cache still holds (block_manager.py): the first `num_cached_blocks`
    blocks of its table are registered there, and `block_hashes` are the chained hashes of its full
    blocks of known tokens (kept across preemptions: its tokens do not change). With async scheduling a
    sampled token stays on the device until the engine's next step has been launched: it is pending
    (counted, not yet in output_token_ids; the latest is row `pending_row` of that step's sampled
    tokens), and the next step reads it there.

    With penalties, `counts_row` is its row of the engine's token counts on the device (-1 before its
    first sample). With prompt_logprobs, the logprobs of prompt tokens 1 .. num_prompt_logprobs have
    been computed (a preempted sequence does not compute them again); they travel in
    `prompt_logprob_parts` until its first token goes out."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text: OutputText
    arrival_time: float
    generator: torch.Generator | None = None
    priority: int = 0  # under the priority scheduling policy, a smaller value starts first (vLLM's)
    arrival_index: int = 0  # its place in arrival order (the scheduler numbers the sequences it is given)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens its first schedule found in the prefix cache
    num_pending: int = 0
    pending_row: int = -1
    counts_row: int = -1
    num_prompt_logprobs: int = 0
    prompt_logprob_parts: list[PromptLogprobsPart] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the length the model sees."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def at_limit(self, max_model_len: int) -> bool:
        """Whether its pending tokens already reach max_tokens or max_model_len: the sequence finishes
        when they arrive, so no further token is computed for it."""
        return self.num_pending > 0 and (len(self.output_token_ids) + self.num_pending >= self.params.max_tokens
                                         or self.num_tokens >= max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end), without building the whole list; a pending token (still on the device)
        reads as 0 here."""
        p, known = len(self.prompt_token_ids), len(self.prompt_token_ids) + len(self.output_token_ids)
        unknown = [0] * (end - max(start, known)) if end > known else []
        end = min(end, known)
        if end <= p:
            return self.prompt_token_ids[start:end] + unknown
        if start >= p:
            return self.output_token_ids[start - p:end - p] + unknown
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p] + unknown

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """The positions among its next `num_new_tokens` whose logits give prompt logprobs not computed
        yet (position p's logits: prompt token p + 1's). Where there are any, the step computes logits
        for all of its new tokens."""
        if self.params.prompt_logprobs is None:
            return range(0)
        start = max(self.num_computed_tokens, self.num_prompt_logprobs)
        return range(start, min(self.num_computed_tokens + num_new_tokens, self.num_prompt_tokens - 1))

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status, self.finish_reason, self.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
