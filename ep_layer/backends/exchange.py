"""Point-to-point exchange of one tensor per peer over a torch.distributed group, with bounded waits.

The reference backend moves data with isend/irecv rather than a collective all-to-all so that every
wait is per source rank: it can be bounded, timed (the wait-cost stats) and, when it runs out, name
exactly the ranks that never arrived.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import EPTimeoutError

_TAG_SPACE = 1 << 20  # gloo tags must stay small; ranks agree on the sequence, so wrap-around is safe


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class PendingExchange:
    """Posted sends and receives of one exchange; `wait` completes them within a deadline."""

    def __init__(self, exchange: PeerExchange, what: str, recvs: list[torch.Tensor | None],
                 works: list[tuple[tuple[int, ...], dist.Work, bool]]) -> None:
        self._exchange = exchange
        self._what = what
        self.recvs = recvs
        self._works = works  # (source or destination peers, work, is_recv)

    def wait(self) -> list[int]:
        """Block until everything arrived; return nanoseconds spent waiting on each source rank."""
        ex = self._exchange
        deadline = time.monotonic() + ex.timeout_s
        waited = [0] * ex.num_ranks
        missing: set[int] = set()
        # Receives first: a send completes only once its peer posted the matching receive (gloo),
        # so waiting on sends first would charge a late source rank's delay to nobody.
        for peers, work, is_recv in sorted(self._works, key=lambda w: not w[2]):
            start = time.perf_counter_ns()
            # After one miss, probe the rest briefly so the error can name every missing rank.
            budget = 0.05 if missing else deadline - time.monotonic()
            if not ex.wait_work(work, budget):
                missing.update(peers)
            elif is_recv:
                for peer in peers:
                    waited[peer] += time.perf_counter_ns() - start
        if missing:
            raise EPTimeoutError(self._what, sorted(missing), ex.timeout_s, ex.rank)
        return waited


class PeerExchange:
    """Sends `sends[r]` to rank r and receives `recvs[s]` from rank s, for every pair at once."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group
        self.rank, self.num_ranks = group_rank_and_size(group)
        self.timeout_s = timeout_s
        self._uses_gloo = self.num_ranks > 1 and dist.get_backend(group) == "gloo"
        self._sequence = 0

    def start(self, what: str, sends: list[torch.Tensor], recvs: list[torch.Tensor | None]
              ) -> PendingExchange:
        """Post all transfers; the tensor for this rank itself is copied locally."""
        tag = self._sequence
        self._sequence = (self._sequence + 1) % _TAG_SPACE
        recvs = list(recvs)
        ops: list[tuple[int, dist.P2POp, bool]] = []
        for peer in range(self.num_ranks):
            if peer == self.rank:
                recvs[peer] = sends[peer].clone()
                continue
            ops.append((peer, dist.P2POp(dist.isend, sends[peer], group=self.group,
                                         group_peer=peer, tag=tag), False))
            ops.append((peer, dist.P2POp(dist.irecv, recvs[peer], group=self.group,
                                         group_peer=peer, tag=tag), True))
        works: list[tuple[tuple[int, ...], dist.Work, bool]] = []
        if ops:
            posted = dist.batch_isend_irecv([op for _, op, _ in ops])
            if len(posted) == len(ops):
                works = [((peer,), w, is_recv) for (peer, _, is_recv), w in zip(ops, posted)]
            else:  # a backend that coalesces (NCCL) gives one work for all: charge every peer
                peers = tuple(p for p in range(self.num_ranks) if p != self.rank)
                works = [(peers, w, True) for w in posted]
        return PendingExchange(self, what, recvs, works)

    def wait_work(self, work: dist.Work, budget_s: float) -> bool:
        """Wait at most `budget_s` for `work`; False if it did not finish in time."""
        if self._uses_gloo:
            try:  # gloo reads a zero timeout as "no timeout": wait at least a millisecond
                work.wait(timeout=timedelta(seconds=max(budget_s, 1e-3)))
            except RuntimeError as e:
                # After one timeout gloo closes the pair, and later waits on it fail at once with
                # "Application timeout caused pair closure": the same peer, still missing.
                if "Timed out" in str(e) or "Application timeout" in str(e):
                    return False
                raise
            return True
        deadline = time.monotonic() + budget_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(20e-6)
        work.wait()
        return True
