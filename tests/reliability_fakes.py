"""An EngineConfig.loader ("reliability_fakes") for the fault tests: serving_fakes' model and tokenizer,
except that
- model "fake": a forward whose batch holds token id POISON raises, the way a bug in a model would, so
  that the rank dies with a traceback;
- model "fake-numbers": a sequence whose last token is NAN_ROW, INF_ROW or DEAD_ROW gets a logits row of
  NaN, one where INF_TOKENS are +inf (the rest NaN, -inf or finite), or one of nothing but -inf and NaN;
  after CURSE_ROW, UNDECODABLE is by far the likeliest token, and the tokenizer's decode raises on it
  (a tokenizer that cannot decode a token the model makes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from serving_fakes import VOCAB, FakeModel, FakeTokenizer

from serving.forward_batch import ForwardBatch

POISON = VOCAB - 1
NAN_ROW, INF_ROW, DEAD_ROW, CURSE_ROW, UNDECODABLE = range(VOCAB - 6, VOCAB - 1)
INF_TOKENS = (2, 3, 4)  # "a", "b", "c"
__all__ = ["CURSE_ROW", "DEAD_ROW", "INF_ROW", "INF_TOKENS", "NAN_ROW", "POISON", "UNDECODABLE", "load_model",
           "load_tokenizer"]


class PoisonedModel(FakeModel):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("a poisoned batch (a model bug, on purpose)")
        return super().forward(batch)


class NumbersModel(FakeModel):
    """FakeModel's logits, but for rows after NAN_ROW, INF_ROW, DEAD_ROW and CURSE_ROW (module docstring)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(batch)
        last = batch.input_ids[batch.logits_indices]  # the token each row's logits follow
        nan, inf = float("nan"), float("inf")
        logits[last == NAN_ROW] = nan
        odd = torch.tensor([nan if t % 3 == 0 else -inf if t % 3 == 1 else 1.0 for t in range(VOCAB)])
        odd[list(INF_TOKENS)] = inf
        logits[last == INF_ROW] = odd
        logits[last == DEAD_ROW] = torch.where(torch.arange(VOCAB) % 2 == 0, -inf, nan)
        logits[last == CURSE_ROW, UNDECODABLE] = 1e4
        return logits


class PickyTokenizer(FakeTokenizer):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if UNDECODABLE in token_ids:
            raise ValueError(f"token {UNDECODABLE} cannot be decoded (on purpose)")
        return super().decode(token_ids, skip_special_tokens)


def load_model(config: Any, group: dist.ProcessGroup | None, device: torch.device) -> tuple[FakeModel, FakeTokenizer]:
    if config.model == "fake-numbers":
        return NumbersModel(config.max_tokens_per_rank, group), PickyTokenizer()
    return PoisonedModel(config.max_tokens_per_rank, group, step_delay_s=0.01), FakeTokenizer()


def load_tokenizer(config: Any) -> FakeTokenizer:
    return PickyTokenizer() if config.model == "fake-numbers" else FakeTokenizer()
