"""How expert-parallel ranks step together (vLLM's DP coordination): before each step, one all-reduce
(MAX, on a small gloo group of its own) of (has work, sequences, has prefill, stop, tokens) decides
whether every rank steps (a rank without work runs an empty batch so the MoE collectives line up), whether
all ranks only decode and then the padded decode batch every rank uses (the largest rank's number of
sequences: every rank replays the same CUDA graph size, idle ranks on padding), the most tokens a rank
holds (which picks the MoE layers' dispatch mode: engine.py), and whether to stop
(all ranks leave together, so none is left waiting in a collective). LLMEngine.step joins it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .heartbeat import RankBeat


@dataclass(frozen=True)
class StepPlan:
    step: bool  # some rank has tokens to compute: all ranks step
    max_num_seqs: int  # the most sequences any rank runs this step
    decode_only: bool  # no rank computes a prefill chunk (decode CUDA graphs apply)
    stop: bool = False  # some rank was told to shut down: all ranks leave
    max_num_tokens: int = 0  # the most tokens any rank computes this step


def plan_alone(num_seqs: int, decode_only: bool, stop: bool = False, num_tokens: int = 0) -> StepPlan:
    """The plan of a rank without peers: it steps on its own sequences, if it has any."""
    return StepPlan(num_seqs > 0 and not stop, num_seqs, num_seqs == 0 or decode_only, stop, num_tokens)


class StepSync:
    """group: a CPU (gloo) group over the ranks, or None for a rank that steps alone. `plan` is the
    latest agreement (before the first: nobody steps). beat: where the server sees that this rank waits
    for its peers in the agreement (None: nowhere)."""

    def __init__(self, group: dist.ProcessGroup | None = None, beat: RankBeat | None = None) -> None:
        self.group, self.beat = group, beat
        self.plan = plan_alone(0, True)
        self._buf = torch.zeros(5, dtype=torch.int64)

    def agree(self, num_seqs: int, decode_only: bool, stop: bool = False, num_tokens: int = 0) -> StepPlan:
        """num_seqs: this rank's sequences this step (0: nothing to do); decode_only: none of them
        computes a prefill chunk; stop: this rank was told to shut down; num_tokens: its tokens this step."""
        if self.group is None:
            self.plan = plan_alone(num_seqs, decode_only, stop, num_tokens)
        else:
            self.plan = self._all_reduce(num_seqs, decode_only, stop, num_tokens)
        return self.plan

    def _all_reduce(self, num_seqs: int, decode_only: bool, stop: bool, num_tokens: int) -> StepPlan:
        """Every rank's plan from the MAX over the ranks of what each one brings."""
        prefill = int(num_seqs > 0 and not decode_only)
        for i, value in enumerate((int(num_seqs > 0), num_seqs, prefill, int(stop), num_tokens)):
            self._buf[i] = value
        if self.beat is not None:
            self.beat.agreeing(True)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        if self.beat is not None:
            self.beat.agreeing(False)
        step, max_seqs, any_prefill, any_stop, max_tokens = self._buf.tolist()
        return StepPlan(bool(step) and not any_stop, max_seqs, not any_prefill, bool(any_stop), max_tokens)
