"""Next tokens from logits: greedy at temperature 0, else temperature, top-k, top-p and a draw from the
request's own seeded generator (or the engine's, for requests without a seed). Nothing here waits for
the GPU: the tokens stay on the device until the caller reads them."""

from __future__ import annotations

import torch

from ..forward_batch import to_device
from .sequence import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one request's draws; any int64 seed (negative ones too) is accepted."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


class Sampler:
    """Samples one token per row of float32 logits [num_seqs, vocab]."""

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.default_generator = make_generator(seed, device)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """The tokens, int64 [num_seqs] on the logits' device."""
        if logits.shape[0] != len(params):
            raise ValueError(f"logits: expected {len(params)} rows (one per sequence), got {logits.shape[0]}")
        tokens = torch.argmax(logits, dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = to_device(sampled, torch.int64, logits.device)
            probs = _probs(logits[rows].float(), [params[i] for i in sampled])
            for j, i in enumerate(sampled):
                gen = generators[i] if generators[i] is not None else self.default_generator
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return tokens


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature restricted to each row's top-k and top-p set."""
    temps = to_device([p.temperature for p in params], logits.dtype, logits.device)
    logits = logits / temps.unsqueeze(1)
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
    return logits.softmax(dim=-1)
