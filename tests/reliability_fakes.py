"""An EngineConfig.loader ("reliability_fakes") for the fault tests: serving_fakes' model and tokenizer,
except that a forward whose batch holds token id POISON raises, the way a bug in a model would, so
that the rank dies with a traceback."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from serving_fakes import VOCAB, FakeModel, FakeTokenizer, load_tokenizer

from serving.forward_batch import ForwardBatch

POISON = VOCAB - 1
__all__ = ["POISON", "load_model", "load_tokenizer"]


class PoisonedModel(FakeModel):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("a poisoned batch (a model bug, on purpose)")
        return super().forward(batch)


def load_model(config: Any, group: dist.ProcessGroup | None, device: torch.device) -> tuple[FakeModel, FakeTokenizer]:
    return PoisonedModel(config.max_tokens_per_rank, group, step_delay_s=0.01), FakeTokenizer()
