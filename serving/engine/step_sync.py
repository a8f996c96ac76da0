"""How expert-parallel ranks step together (vLLM's DP coordination): before each step, one all-reduce
(MAX, on a small gloo group of its own) of (has work, stop) decides whether every rank steps (a rank
without work runs an empty batch so the MoE collectives line up) and whether to stop (all ranks leave
together, so none is left waiting in a collective). Ranks need not agree on their batch sizes: every
rank dispatches with the same T (max_tokens_per_rank) and its own number of tokens, so each one
replays the decode graph that fits its own batch (see model_runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepPlan:
    step: bool  # some rank has tokens to compute: all ranks step
    stop: bool = False  # some rank was told to shut down: all ranks leave


class StepSync:
    """group: a CPU (gloo) group over the ranks, or None for a rank that steps alone."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._buf = torch.zeros(2, dtype=torch.int64)

    def agree(self, num_tokens: int, stop: bool = False) -> StepPlan:
        if self.group is None:
            return StepPlan(num_tokens > 0 and not stop, stop)
        self._buf[0], self._buf[1] = int(num_tokens > 0), int(stop)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        step, any_stop = self._buf.tolist()
        return StepPlan(bool(step) and not any_stop, bool(any_stop))
