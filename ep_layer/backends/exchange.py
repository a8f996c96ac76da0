"""Point-to-point exchange of one tensor per peer over a torch.distributed group, with bounded waits.

The reference backend moves data with isend/irecv rather than a collective all-to-all so that every
wait is per source rank: it can be bounded, timed (the wait-cost stats) and, when it runs out, name
exactly the ranks that never arrived, or (rank masking) leave them out of every later exchange.
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
                 works: list[tuple[tuple[int, ...], dist.Work, bool]], broken: set[int]) -> None:
        self._exchange = exchange
        self._what = what
        self.recvs = recvs
        self._works = works  # (source or destination peers, work, is_recv)
        self._broken = broken  # peers whose transfers could not even be posted (masking only)

    def wait(self) -> list[int]:
        """Block until everything arrived; return nanoseconds spent waiting on each source rank. A rank
        that did not arrive in time raises EPTimeoutError, or with masking is masked from then on and
        its receive becomes None."""
        ex = self._exchange
        deadline = time.monotonic() + ex.timeout_s
        waited = [0] * ex.num_ranks
        missing = set(self._broken)
        # Receives first: a send completes only once its peer posted the matching receive (gloo),
        # so waiting on sends first would charge a late source rank's delay to nobody.
        for peers, work, is_recv in sorted(self._works, key=lambda w: not w[2]):
            if missing.issuperset(peers):
                continue
            start = time.perf_counter_ns()
            # After one miss, probe the rest briefly so the error can name every missing rank.
            budget = 0.05 if missing else deadline - time.monotonic()
            if not ex.wait_work(work, budget):
                missing.update(peers)
            elif is_recv:
                for peer in peers:
                    waited[peer] += time.perf_counter_ns() - start
        if missing and ex.masked is None:
            raise EPTimeoutError(self._what, sorted(missing), ex.timeout_s, ex.rank)
        if ex.masked is not None:
            ex.masked.update(missing)
            for peer in ex.masked:
                self.recvs[peer] = None
        return waited


class PeerExchange:
    """Sends `sends[r]` to rank r and receives `recvs[s]` from rank s, for every pair at once."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float, masked: set[int] | None = None) -> None:
        self.group = group
        self.rank, self.num_ranks = group_rank_and_size(group)
        self.timeout_s = timeout_s
        # Ranks that no exchange sends to or waits for (rank masking); None: masking is off, and a rank
        # that does not arrive in time is an error.
        self.masked = masked
        self._uses_gloo = self.num_ranks > 1 and dist.get_backend(group) == "gloo"
        self._sequence = 0
        # With masking over gloo, each pair of ranks talks over a group of its own: a gloo wait that times
        # out closes every connection of its group, and only the late peer's may go.
        self._pair_groups: dict[int, dist.ProcessGroup] = {}
        if masked is not None and self._uses_gloo:
            self._pair_groups = _pair_groups(group, self.rank, self.num_ranks)

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
            if self.masked is not None and peer in self.masked:
                continue
            ops.append((peer, dist.P2POp(dist.isend, sends[peer], group=self.group,
                                         group_peer=peer, tag=tag), False))
            ops.append((peer, dist.P2POp(dist.irecv, recvs[peer], group=self.group,
                                         group_peer=peer, tag=tag), True))
        works: list[tuple[tuple[int, ...], dist.Work, bool]] = []
        broken: set[int] = set()
        if ops and self._pair_groups:
            # One by one, over the pair's group: gloo refuses to post to a peer whose process died, and
            # that peer is then missing.
            for peer, op, is_recv in ops:
                pair, in_pair = self._pair_groups[peer], int(peer > self.rank)
                try:
                    work = pair.recv([op.tensor], in_pair, tag) if is_recv else pair.send([op.tensor], in_pair, tag)
                    works.append(((peer,), work, is_recv))
                except RuntimeError:
                    broken.add(peer)
        elif ops:
            posted = dist.batch_isend_irecv([op for _, op, _ in ops])
            if len(posted) == len(ops):
                works = [((peer,), w, is_recv) for (peer, _, is_recv), w in zip(ops, posted)]
            else:  # a backend that coalesces (NCCL) gives one work for all: charge every peer
                peers = tuple(sorted({peer for peer, _, _ in ops}))
                works = [(peers, w, True) for w in posted]
        return PendingExchange(self, what, recvs, works, broken)

    def wait_work(self, work: dist.Work, budget_s: float) -> bool:
        """Wait at most `budget_s` for `work`; False if it did not finish in time (or, with masking, if
        its peer's connection broke)."""
        if self._uses_gloo:
            try:  # gloo reads a zero timeout as "no timeout": wait at least a millisecond
                work.wait(timeout=timedelta(seconds=max(budget_s, 1e-3)))
            except RuntimeError as e:
                # After one timeout gloo closes the pair, and later waits on it fail at once with
                # "Application timeout caused pair closure": the same peer, still missing. With masking,
                # a peer whose connection broke (its process died) is missing too.
                if "Timed out" in str(e) or "Application timeout" in str(e) or self.masked is not None:
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


_pair_group_sets: dict[tuple[int, ...], int] = {}  # group members -> pair-group sets made for them so far


def _pair_groups(group: dist.ProcessGroup | None, rank: int, num_ranks: int) -> dict[int, dist.ProcessGroup]:
    """A two-rank gloo group with each peer, through the default store; every rank of `group` makes its
    sets in the same order (one per masking Buffer, as Buffers are made), so the names agree. Not
    c10d.new_group: it would need every rank of the world, and only these talk."""
    members = tuple(dist.get_process_group_ranks(group))
    made = _pair_group_sets[members] = _pair_group_sets.get(members, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"ep_layer/pairs/{'_'.join(map(str, members))}/{made}"
    pairs = {}
    for peer in range(num_ranks):
        if peer != rank:
            a, b = min(rank, peer), max(rank, peer)
            pairs[peer] = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/{a}_{b}/", store), int(rank == b), 2,
                                                timedelta(seconds=300))
    return pairs
