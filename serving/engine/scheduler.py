"""Continuous batching with chunked prefill: each step takes up to `token_budget` tokens (the MoE
layer's T), running sequences first (one decode token each, or the next chunk of their prompt), then
waiting ones, each starting after the longest prefix the prefix cache holds for it (block_manager.py).
With `long_prefill_token_threshold` > 0 (vLLM's), no sequence takes more tokens than that in one step, so
that a long prompt's chunks do not slow the steps of the sequences decoding beside it.
When the KV cache runs out, a running sequence is preempted and recomputed later (its blocks stay in the
prefix cache until they are reused): the newest under the "fcfs" policy, the one of lowest priority under
"priority" (vLLM's: the largest `priority` value, the latest among equals). Waiting sequences start in
arrival order, or by priority, then arrival (vLLM 0.34.0's vllm/v1/core/sched/scheduler.py and
request_queue.py). A running sequence whose pending tokens (async scheduling) will finish it is left out."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .engine_config import SCHEDULING_POLICIES
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, its next `num_new_tokens` uncomputed tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes just its last token (the case CUDA graphs cover)."""
        return all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens
                   for s, n in zip(self.seqs, self.num_new_tokens))

    def __bool__(self) -> bool:
        return bool(self.seqs)


class WaitingQueue:
    """The sequences waiting to start (again, after a preemption), in the order they start: by arrival, or by
    (priority, arrival). A preempted sequence keeps its place in arrival order: before every sequence that
    arrived after it."""

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._seqs: list[Sequence] = []  # sorted by `order`

    def order(self, seq: Sequence) -> tuple[int, int]:
        """Where a sequence starts: (priority, arrival) under the priority policy, else (0, arrival)."""
        return (seq.priority if self._by_priority else 0, seq.arrival_index)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._seqs, seq, key=self.order)

    def first(self) -> Sequence:
        return self._seqs[0]

    def pop_first(self) -> Sequence:
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs, self.token_budget, self.max_model_len = max_num_seqs, token_budget, max_model_len
        # A sequence's most tokens in one step (0: the budget's).
        self.chunk_cap = long_prefill_token_threshold or token_budget
        self.by_priority = policy == "priority"
        self.waiting = WaitingQueue(self.by_priority)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.arrival_index = next(self._arrivals)
        self.waiting.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_prompt_work(self) -> bool:
        """Whether the next schedule may take prompt tokens: a waiting sequence with room to run, or a
        running one part way through its prompt."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return True
        return any(seq.num_uncomputed_tokens > 1 for seq in self.running)

    def may_take_more_than(self, tokens: int) -> bool:
        """Whether the next schedule may take more than `tokens` tokens (an upper bound: a prompt's cached prefix,
        blocks and preemption are not looked at)."""
        if tokens >= self.token_budget:
            return False
        room = max(0, self.max_num_seqs - len(self.running))
        total = 0
        for seq in itertools.chain(self.running, itertools.islice(self.waiting, room)):
            total += min(max(seq.num_uncomputed_tokens, 1), self.chunk_cap)
            if total > tokens:
                return True
        return False

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget
        bm = self.block_manager
        if bm.enable_caching:
            for seq in self.running:  # what the last steps computed becomes a hit for the sequences admitted now
                bm.cache_blocks(seq)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.at_limit(self.max_model_len):
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget, self.chunk_cap)
            target = seq.num_computed_tokens + n
            while not self.block_manager.can_grow(seq, target):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if victim in batch.seqs:  # scheduled earlier in this step (priority only): its tokens go back
                    k = batch.seqs.index(victim)
                    budget += batch.num_new_tokens[k]
                    del batch.seqs[k], batch.num_new_tokens[k]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                if at < i:
                    i -= 1
            if seq.status is SequenceStatus.WAITING:  # it preempted itself: the sequences after it may fit
                continue
            self.block_manager.grow(seq, target)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting.first()
            hits = bm.lookup(seq)  # None: it does not read the cache (off, or it wants prompt logprobs)
            found = hits or []
            cached = len(found) * bm.block_size
            n = min(seq.num_tokens - cached, budget, self.chunk_cap)
            if not bm.can_admit(seq, found, cached + n):
                break
            self.waiting.pop_first()
            bm.admit(seq, found, cached + n)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time, seq.num_cached_tokens = now, cached
                if hits is not None:
                    bm.stats.record(seq.num_tokens, cached)
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest (fcfs), or the one of lowest priority (priority)."""
        if self.by_priority:  # the latest to start were it waiting
            return max(self.running, key=self.waiting.order)
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)
        self.num_preemptions += 1
