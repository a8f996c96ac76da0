"""Whether the engine ranks make progress, as the server sees it: each rank writes, in memory it shares
with the server, when its loop last passed and whether it is waiting for its peers in the step
agreement. An idle rank passes its loop at least every second (rank_worker), so a rank whose last pass
is older than the stall timeout is stuck, busy or idle: stopped (SIGSTOP), hung in a step, or waiting
for a peer that is. The server names the ranks to blame (`stalled`) and answers 503 while they are."""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext
from typing import Any

DEFAULT_STALL_TIMEOUT_S = 10.0  # --rank-stall-timeout


class Heartbeats:
    """One slot per local rank: the monotonic time (CLOCK_MONOTONIC, the same in every process of the
    host) of its last loop pass, and whether it is in the step agreement now. Made by the server before
    the ranks are spawned; each rank gets `beat(i)` for its own slot."""

    def __init__(self, ctx: BaseContext, num_ranks: int) -> None:
        self._last_pass = ctx.RawArray("d", num_ranks)
        self._agreeing = ctx.RawArray("b", num_ranks)

    def beat(self, index: int) -> RankBeat:
        return RankBeat(self._last_pass, self._agreeing, index)

    def restart(self, now: float) -> None:
        """Count every rank as having passed at `now` (the ranks are ready and about to loop)."""
        for i in range(len(self._last_pass)):
            self._last_pass[i] = now

    def stalled(self, now: float, timeout_s: float, pids: list[int | None]) -> tuple[list[int], float]:
        """(the local ranks to blame, how long the longest of them has made no progress); ([], 0) when
        every rank passed its loop within timeout_s. Of the ranks past the timeout, those the operating
        system shows stopped are blamed; else those not waiting for their peers in the step agreement
        (the others wait for them); else all of them."""
        late = [i for i, t in enumerate(self._last_pass) if now - t > timeout_s]
        if not late:
            return [], 0.0
        stopped = [i for i in late if _stopped(pids[i])]
        blamed = stopped or [i for i in late if not self._agreeing[i]] or late
        return blamed, max(now - self._last_pass[i] for i in blamed)


class RankBeat:
    """A rank's own slot of Heartbeats (picklable: it travels to the rank process)."""

    def __init__(self, last_pass: Any, agreeing: Any, index: int) -> None:
        self._last_pass, self._agreeing, self._index = last_pass, agreeing, index

    def passed(self) -> None:
        """The rank's loop came round: it makes progress."""
        self._last_pass[self._index] = time.monotonic()

    def agreeing(self, now: bool) -> None:
        """The rank enters (True) or leaves (False) the step agreement, where it waits for its peers."""
        self._agreeing[self._index] = int(now)


def _stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped by a signal or a tracer (/proc state T or t; False where unknown)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"
