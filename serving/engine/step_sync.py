"""How expert-parallel ranks step together (vLLM's DP coordination): before each step, one all-reduce
(MAX, on a small gloo group of its own) of (has work, tokens, stop) decides whether every rank steps (a
rank without work runs an empty batch so the MoE collectives line up), the most tokens a rank holds
(which picks the MoE layers' dispatch mode and the step graph every rank replays, idle ranks on padding:
engine.py), and whether to stop (all ranks leave together, so none is left waiting in a collective).
LLMEngine.step joins it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .heartbeat import RankBeat


@dataclass(frozen=True)
class StepPlan:
    step: bool  # some rank has tokens to compute: all ranks step
    max_num_tokens: int = 0  # the most tokens any rank computes this step
    stop: bool = False  # some rank was told to shut down: all ranks leave


def plan_alone(num_tokens: int, stop: bool = False) -> StepPlan:
    """The plan of a rank without peers: it steps on its own tokens, if it has any."""
    return StepPlan(num_tokens > 0 and not stop, num_tokens, stop)


class StepSync:
    """group: a CPU (gloo) group over the ranks, or None for a rank that steps alone. `plan` is the
    latest agreement (before the first: nobody steps). beat: where the server sees that this rank waits
    for its peers in the agreement (None: nowhere)."""

    def __init__(self, group: dist.ProcessGroup | None = None, beat: RankBeat | None = None) -> None:
        self.group, self.beat = group, beat
        self.plan = plan_alone(0)
        self._buf = torch.zeros(3, dtype=torch.int64)

    def agree(self, num_tokens: int, stop: bool = False) -> StepPlan:
        """num_tokens: this rank's tokens this step (0: nothing to do); stop: this rank was told to shut down."""
        if self.group is None:
            self.plan = plan_alone(num_tokens, stop)
        else:
            self.plan = self._all_reduce(num_tokens, stop)
        return self.plan

    def _all_reduce(self, num_tokens: int, stop: bool) -> StepPlan:
        """Every rank's plan from the MAX over the ranks of what each one brings."""
        for i, value in enumerate((int(num_tokens > 0), num_tokens, int(stop))):
            self._buf[i] = value
        if self.beat is not None:
            self.beat.agreeing(True)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        if self.beat is not None:
            self.beat.agreeing(False)
        step, max_tokens, any_stop = self._buf.tolist()
        return StepPlan(bool(step) and not any_stop, max_tokens, bool(any_stop))
