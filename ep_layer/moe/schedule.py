"""Running a layer's forward written as steps: a generator that yields right after each send half.

Between a send and its hook the caller may run anything, typically the other micro-batch's compute
(or, with emulated ranks on one GPU, the other ranks' sends). Round-robin over several step
generators gives exactly the overlapped schedule; running one to its end gives the plain one.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TypeVar

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
