"""Running a layer's forward written as steps: a generator that yields once its routing is queued (ROUTED),
right after each send half (DISPATCH_SENT, COMBINE_SENT), once its shared expert is queued (SHARED_QUEUED)
and after each hook is queued on a side stream (DISPATCH_HOOKED, COMBINE_HOOKED), before anything waits
for it.

Between a send and its hook the caller may run anything: the other micro-batch's compute, or, with
emulated ranks on one GPU, the other ranks' sends (every rank's send of an op must be queued before
any hook of it) and shared experts (ranks on their own GPUs run theirs at the same time, so the
communication travels under all of them; queued rank after rank with the compute behind it, it would
travel under the first rank's alone). Running one generator to its end is the plain forward;
`run_interleaved` steps several in turn (emulated ranks); `run_two_microbatches` is the overlapped schedule.

On one CUDA stream the overlapped schedule only reorders work. With `CommStreams` the communication
kernels run on side streams, concurrently with the compute on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

from .. import streams

Result = TypeVar("Result")
ROUTED = "routed"
DISPATCH_SENT, DISPATCH_HOOKED = "dispatch sent", "dispatch hooked"
COMBINE_SENT, COMBINE_HOOKED = "combine sent", "combine hooked"
SHARED_QUEUED = "shared expert queued"
# After these marks a micro-batch of run_two_microbatches keeps the turn: what follows belongs with them
# (a send's hook; the compute after the shared expert).
KEEPS_TURN = (DISPATCH_SENT, COMBINE_SENT, SHARED_QUEUED)
Steps = Generator[str, None, Result]  # yields one of the six marks above


def run_to_end(steps: Steps[Result]) -> Result:
    """Run every step of one generator; return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def run_interleaved(all_steps: Sequence[Steps[Result]]) -> list[Result]:
    """Advance each generator by one step in turn until all are done; their results, in order."""
    results: list[Result | None] = [None] * len(all_steps)
    pending = list(range(len(all_steps)))
    while pending:
        for i in list(pending):
            try:
                next(all_steps[i])
            except StopIteration as stop:
                results[i] = stop.value
                pending.remove(i)
    return results  # type: ignore[return-value]


def run_two_microbatches(first: Sequence[Steps[Result]], second: Sequence[Steps[Result]]
                         ) -> tuple[list[Result], list[Result]]:
    """The two-micro-batch schedule: `first` and `second` hold each micro-batch's generators (one per
    emulated rank, or one) and take turns, every generator of a group one step per turn; a group that
    has just sent keeps the turn to queue that op's hook, and one that has just queued its shared expert
    keeps it to go on with its compute. Both halves route before the first dispatch send: routing the
    second half under the first one's dispatch made the overlapped layer slower, with the many-kernel
    router and the one-kernel one alike (benchmarks/RESULTS.md, bench_moe.py). On a side
    stream a hook runs right after its send, not behind the other micro-batch's send: the first half's
    dispatch travels while its shared expert computes, its combine under the second half's experts, and
    the second half's combine under the second half's shared expert (FusedMoE.steps with
    shared_under="combine"). Each micro-batch may chain several layers (`yield from`)."""
    groups = [list(first), list(second)]
    results: list[list[Result | None]] = [[None] * len(g) for g in groups]
    pending = [list(range(len(g))) for g in groups]
    turn = 0
    while pending[0] or pending[1]:
        marks = set()
        for i in list(pending[turn]):
            try:
                marks.add(next(groups[turn][i]))
            except StopIteration as stop:
                results[turn][i] = stop.value
                pending[turn].remove(i)
        if len(marks) != 1 or marks.pop() not in KEEPS_TURN or not pending[turn]:
            turn ^= 1
    return results[0], results[1]  # type: ignore[return-value]


@dataclass(frozen=True)
class CommStreams:
    """Side streams for a layer's dispatch and combine, so that one micro-batch's communication runs
    while the other's experts compute on the current stream.

    Dispatch and combine get a stream each: a Buffer's calls of one op must launch in call order (the
    kernels take their sequence numbers in launch order), and on one shared stream a micro-batch's
    dispatch hook would queue behind the other's combine send, which waits for that one's experts.
    Emulated ranks on one GPU share one CommStreams: every rank's send of an op is then queued before
    any hook of it, so no receive spins on a send that has not started (ep_layer.emulation's rule).
    """

    dispatch: torch.cuda.Stream
    combine: torch.cuda.Stream

    @classmethod
    def new(cls, device: torch.device | str | int | None = None) -> CommStreams:
        # The highest priority (out-of-range values map to it): when SMs free up, the block scheduler
        # starts the short communication kernels, which the next compute waits for, before more GEMM tiles.
        return cls(torch.cuda.Stream(device, priority=-100), torch.cuda.Stream(device, priority=-100))


@contextmanager
def send_on(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None = None) -> Iterator[None]:
    """Queue a send half on `stream` (None: the current stream), after all work queued on the current
    stream so far: its inputs; or, given `after` (an event recorded on the current stream), after the work
    queued before that event only (single-batch overlap: the send runs beside the GEMM queued since).
    Its outputs belong to `stream`: use them after its hook's wait (run_hook)."""
    if stream is None:
        yield
        return
    if after is None:
        streams.join(stream, streams.current_stream(stream.device_index))
    else:
        after.wait(stream)
    with streams.on_stream(stream):
        yield


def run_hook(hook: Callable[[], None], stream: torch.cuda.Stream | None) -> Callable[[], None]:
    """Run `hook` (a receive half) on `stream`, right behind its send half and without waiting for the
    compute queued since (what it overlaps). Returns the function that makes the current stream wait
    for it, before the received tensors are used (a no-op without a stream: the hook ran in order).

    Allocator safety without record_stream: side-stream tensors used on the current stream are freed
    after that wait, and each later side-stream allocation comes from a send queued behind the current
    stream's work (send_on), or from a hook behind such a send."""
    if stream is None:
        hook()
        return lambda: None
    with streams.on_stream(stream):
        hook()
    done = streams.record(stream)
    return lambda: done.wait(streams.current_stream(stream.device_index))
