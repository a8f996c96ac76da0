"""Running a layer's forward written as steps: a generator that yields right after each send half.

Between a send and its hook the caller may run anything, typically the other micro-batch's compute
(or, with emulated ranks on one GPU, the other ranks' sends). Round-robin over several step
generators gives exactly the overlapped schedule; running one to its end gives the plain one.

On one CUDA stream the overlapped schedule only reorders work. With `CommStreams` the communication
kernels run on side streams, concurrently with the compute on the current stream.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

Result = TypeVar("Result")
Steps = Generator[None, None, Result]


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
def send_on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Queue a send half on `stream` (None: the current stream), after all work queued on the current
    stream so far: its inputs. Its outputs then belong to `stream`: `join` it before using them."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


@contextmanager
def hook_on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Queue a hook on `stream`, right behind its send half and without waiting for the compute queued
    since (what it overlaps)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def join(stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on `stream` (None: nothing to wait for).

    Allocator safety without record_stream: side-stream tensors used on the current stream are freed
    only after the join, and each later side-stream allocation comes from a send queued behind the
    current stream's work (send_on), or from a hook behind such a send."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
