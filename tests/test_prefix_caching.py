"""Automatic prefix caching (serving/engine/block_manager.py, block_hash.py), on CPU:

- the block manager alone: chained hashes, reference counts, the eviction order, hits taking blocks off
  the free queue, reset; random operation sequences (hypothesis) against a model that keys the cache by
  the prefix's tokens themselves and checks every hit's KV slots;
- the engine on the fake model (tests/serving_fakes.py, whose logits read the KV back through the block
  tables): random prompts sharing random prefixes, arriving over time, with chunked prefill, mixed
  batches, aborts, preemption, async scheduling and at EP 2 give the same tokens with caching on and off
  (and the reference's), while caching computes fewer tokens; seeded sampling; prompt logprobs;
- the tiny DeepSeek-V3 on CPU: the MLA attention of a prompt that starts after a cached prefix;
- on a GPU (`gpu` marker): the same with step CUDA graphs.

The HTTP side (metrics, the reset endpoint, the flags, echo) is tests/test_prefix_caching_http.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from dist_harness import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fakes import FakeModel, FakeTokenizer, reference_greedy

from serving.engine.block_hash import ROOT, hash_block
from serving.engine.block_manager import BlockManager
from serving.engine.detokenizer import OutputText, as_codec
from serving.engine.engine import LLMEngine
from serving.engine.messages import RequestOutput
from serving.engine.model_runner import slot_of
from serving.engine.sequence import SamplingParams, Sequence
from serving.engine.step_sync import StepSync

TOK = FakeTokenizer()
CODEC = as_codec(TOK)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def seq_of(tokens: list[int], rid: str = "r", params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(rid, list(tokens), params, OutputText(CODEC, list(tokens)), 0.0)


def run_prompt(bm: BlockManager, tokens: list[int], rid: str = "r", params: SamplingParams = GREEDY) -> Sequence:
    """Admit a sequence of `tokens` on its cached prefix and compute the rest of its prompt (blocks
    registered); it keeps its blocks."""
    seq = seq_of(tokens, rid, params)
    hits = bm.lookup(seq) or []
    assert bm.can_admit(seq, hits, seq.num_tokens)
    bm.admit(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)
    return seq


# ---------------------------------------------------------------------------- the block manager
def test_block_hashes_chain_their_parents():
    a = hash_block(ROOT, [1, 2, 3, 4])
    assert len(a) == 32 and a == hash_block(ROOT, [1, 2, 3, 4])
    assert hash_block(ROOT, [1, 2, 3, 5]) != a and hash_block(a, [1, 2, 3, 4]) != a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(ROOT, [9, 2, 3, 4]), [5, 6, 7, 8])
    # Token ids are fixed-width: [1, 2] and [258] would collide in a byte-per-token encoding.
    assert hash_block(ROOT, [1, 2]) != hash_block(ROOT, [258])


def test_equal_prefixes_hit_and_a_change_misses_every_later_block():
    bm = BlockManager(32, 4)
    base = list(range(1, 13))  # 3 full blocks
    first = run_prompt(bm, base, "a")
    assert bm.num_cached_blocks == 3
    assert bm.lookup(seq_of([*base, 40])) == first.block_table  # the whole prefix, 3 blocks
    assert bm.lookup(seq_of(base)) == first.block_table[:2]  # never the whole prompt: its last token computes
    assert bm.lookup(seq_of(base[:9])) == first.block_table[:2]
    assert bm.lookup(seq_of(base[:4])) == []  # 4 tokens: the one full block holds the last token
    changed_first = [99, *base[1:], 40]
    assert bm.lookup(seq_of(changed_first)) == []  # blocks 1 and 2 hold the same tokens, behind another parent
    changed_second = [*base[:5], 99, *base[6:], 40]
    assert bm.lookup(seq_of(changed_second)) == first.block_table[:1]


def test_shared_blocks_are_counted_and_freed_by_their_last_holder():
    bm = BlockManager(16, 4)
    prefix = list(range(1, 9))
    a = run_prompt(bm, [*prefix, 20, 21], "a")  # 3 blocks: 2 full, 1 partial
    b = run_prompt(bm, [*prefix, 30], "b")
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [bm.ref_count(x) for x in shared] == [2, 2]
    assert bm.num_free_blocks == 16 - 4 and bm.usage == pytest.approx(4 / 16)  # shared blocks count once
    tail = a.block_table[2]
    bm.free(a)
    assert [bm.ref_count(x) for x in shared] == [1, 1] and not set(shared) & set(bm.free_queue())
    assert bm.free_queue()[0] == tail  # not full, so not cached: the first to be reused
    bm.free(b)
    assert set(shared) <= set(bm.free_queue()) and bm.usage == 0.0
    assert bm.lookup(seq_of([*prefix, 50])) == shared  # free, but still cached
    assert a.block_table == [] and a.num_cached_blocks == 0


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(8, 4)
    a = run_prompt(bm, [1] * 8, "a")  # blocks 0, 1
    b = run_prompt(bm, [2] * 8, "b")  # blocks 2, 3
    c = run_prompt(bm, [3] * 2, "c")  # block 4: partial, never cached
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4])
    for seq in (a, b, c):
        bm.free(seq)
    # Blocks without a hash first, then a's (its tail block first), then b's.
    assert bm.free_queue() == [4, 5, 6, 7, 1, 0, 3, 2]
    filler = seq_of([9] * 20, "f")
    bm.admit(filler, [], 20)  # 5 blocks: 4, 5, 6, 7 and a's tail block
    assert filler.block_table == [4, 5, 6, 7, 1]
    assert bm.lookup(seq_of([1] * 9)) == [0] and bm.lookup(seq_of([2] * 9)) == [2, 3]
    bm.grow(filler, 24)  # and a's first block
    assert bm.lookup(seq_of([1] * 9)) == [] and bm.lookup(seq_of([2] * 9)) == [2, 3]


def test_a_hit_on_a_free_block_takes_it_off_the_free_queue():
    bm = BlockManager(3, 4)
    a = run_prompt(bm, list(range(1, 9)), "a")
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    b = seq_of([*list(range(1, 9)), 20, 21, 22, 23, 24])  # 13 tokens, 4 blocks: 2 hits and 2 new
    hits = bm.lookup(b)
    assert hits == [0, 1]
    # The two hits come off the free queue too: 2 new + 2 revived > 3 free.
    assert not bm.can_admit(b, hits, 13)
    assert bm.can_admit(b, hits, 12) and bm.can_admit(b, hits, 9)
    bm.admit(b, hits, 9)
    assert b.block_table == [0, 1, 2] and b.num_computed_tokens == 8 and b.num_cached_blocks == 2
    assert bm.free_queue() == [] and [bm.ref_count(x) for x in range(3)] == [1, 1, 1]


def test_blocks_with_a_pending_token_or_uncomputed_tokens_are_not_cached():
    bm = BlockManager(8, 4)
    seq = seq_of(list(range(1, 8)))  # 7 prompt tokens
    bm.admit(seq, [], 8)
    seq.num_pending = 1  # its first sampled token, still on the device: token 8 is unknown here
    seq.num_computed_tokens = 8
    bm.cache_blocks(seq)
    assert bm.num_cached_blocks == 1 and seq.num_cached_blocks == 1
    seq.num_pending, seq.output_token_ids = 0, [30]
    bm.cache_blocks(seq)
    assert bm.num_cached_blocks == 2
    assert bm.lookup(seq_of([*list(range(1, 8)), 30, 31])) == seq.block_table
    partial = seq_of(list(range(40, 49)))
    bm.admit(partial, [], 9)
    partial.num_computed_tokens = 6  # a chunk: its second block is not computed yet
    bm.cache_blocks(partial)
    assert partial.num_cached_blocks == 1


def test_prompt_logprobs_sequences_write_but_do_not_read_the_cache():
    bm = BlockManager(16, 4)
    wants = SamplingParams(max_tokens=1, prompt_logprobs=2)
    a = run_prompt(bm, list(range(1, 10)), "a", wants)
    assert a.num_cached_blocks == 2 and bm.lookup(seq_of(list(range(1, 10)), params=wants)) is None
    assert bm.lookup(seq_of(list(range(1, 10)))) == a.block_table[:2]


def test_reset_forgets_the_cache_only_when_no_block_is_held():
    bm = BlockManager(16, 4)
    a = run_prompt(bm, list(range(1, 10)), "a")
    assert not bm.reset() and bm.lookup(seq_of(list(range(1, 10)))) == a.block_table[:2]
    bm.free(a)
    assert bm.reset() and bm.num_cached_blocks == 0 and bm.lookup(seq_of(list(range(1, 10)))) == []
    assert bm.num_free_blocks == 16


def test_caching_off_shares_nothing():
    bm = BlockManager(16, 4, enable_caching=False)
    a = run_prompt(bm, list(range(1, 10)), "a")
    b = run_prompt(bm, list(range(1, 10)), "b")
    assert bm.lookup(b) is None and not set(a.block_table) & set(b.block_table) and bm.num_cached_blocks == 0
    assert b.num_computed_tokens == 9 and b.num_cached_blocks == 0


# ---------------------------------------------------------------------------- random operations against a model
class CacheModel:
    """The prefix cache as a plain reading of the rules: the cache maps a prefix's token tuple (not a hash)
    to the block that holds its last block; the free queue is a list; `kv` holds the token each slot was
    last written with (by a `compute`, as the model does)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.key: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cache: dict[tuple[int, ...], int] = {}
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.kv = [-1] * (num_blocks * block_size)

    def lookup(self, known: list[int], num_tokens: int) -> list[int]:
        hits = []
        for i in range(min((num_tokens - 1) // self.bs, len(known) // self.bs)):
            block = self.cache.get(tuple(known[:(i + 1) * self.bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        new = -(-num_tokens // self.bs) - len(hits)
        return new + sum(self.refs[b] == 0 for b in hits) <= len(self.free)

    def take(self) -> int:
        block = self.free.pop(0)
        if self.key[block] is not None:
            del self.cache[self.key[block]]
            self.key[block] = None
        self.refs[block] = 1
        return block

    def admit(self, rid: str, hits: list[int], num_tokens: int) -> None:
        for b in hits:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1
        self.tables[rid] = list(hits)
        self.cached[rid] = len(hits)
        self.grow(rid, num_tokens)

    def grow(self, rid: str, num_tokens: int) -> None:
        while len(self.tables[rid]) * self.bs < num_tokens:
            self.tables[rid].append(self.take())

    def cache_blocks(self, rid: str, known: list[int], computed: int) -> None:
        full = min(computed, len(known)) // self.bs
        for i in range(self.cached[rid], full):
            key, block = tuple(known[:(i + 1) * self.bs]), self.tables[rid][i]
            if self.key[block] is None and key not in self.cache:
                self.key[block], self.cache[key] = key, block
        self.cached[rid] = max(self.cached[rid], full)

    def free_blocks(self, rid: str, known: list[int], computed: int) -> None:
        self.cache_blocks(rid, known, computed)
        for block in reversed(self.tables.pop(rid)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.key[block] is None:
                    self.free.insert(0, block)
                else:
                    self.free.append(block)
        del self.cached[rid]

    def reset(self) -> bool:
        if any(self.refs):
            return False
        self.cache.clear()
        self.key = [None] * len(self.key)
        return True


def known_tokens(seq: Sequence) -> list[int]:
    return seq.prompt_token_ids + seq.output_token_ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([2, 4]), st.integers(4, 14))
def test_random_operations_match_the_model(data: st.DataObject, block_size: int, num_blocks: int):
    """Sequences over a 2-token alphabet (so prefixes collide often) are added, admitted on their cached
    prefix, computed a chunk at a time, sampled (a pending token, then received), finished or preempted,
    and the cache reset, in random order. After every operation the block tables, reference counts,
    free queue (in order) and cache size equal the model's, a hit's blocks hold exactly the sequence's
    tokens, a sequence writes only blocks it holds alone, and every computed slot holds its token."""
    bm, model = BlockManager(num_blocks, block_size), CacheModel(num_blocks, block_size)
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    truth: dict[str, list[int]] = {}  # every token of a sequence, its pending one included
    names = iter(range(10**6))

    def check() -> None:
        holders = [0] * num_blocks
        for seq in running:
            assert seq.block_table == model.tables[seq.request_id]
            for b in seq.block_table:
                holders[b] += 1
            for p in range(seq.num_computed_tokens):
                b = seq.block_table[p // block_size]
                assert model.kv[b * block_size + p % block_size] == truth[seq.request_id][p], (seq.request_id, p)
        assert [bm.ref_count(b) for b in range(num_blocks)] == holders == model.refs
        assert bm.free_queue() == model.free
        assert bm.num_cached_blocks == len(model.cache)
        for seq in waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0

    for _ in range(data.draw(st.integers(1, 60), label="operations")):
        ops = ["add", "reset"]
        ops += ["admit"] * bool(waiting)
        ops += ["compute", "finish", "preempt"] * bool(running)
        if any(s.num_computed_tokens == s.num_tokens and not s.num_pending for s in running):
            ops.append("sample")
        if any(s.num_pending for s in running + waiting):
            ops.append("receive")
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "add":
            base = data.draw(st.sampled_from([[]] + [t for t in truth.values()]), label="shares")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            tail = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=9), label="tail")
            prompt = base[:cut] + tail
            if -(-(len(prompt) + 3) // block_size) > num_blocks:
                continue
            rid = f"s{next(names)}"
            truth[rid] = list(prompt)
            waiting.append(seq_of(prompt, rid))
        elif op == "admit":
            seq = waiting[data.draw(st.integers(0, len(waiting) - 1), label="which")]
            hits = bm.lookup(seq)
            assert hits == model.lookup(known_tokens(seq), seq.num_tokens)
            for i, b in enumerate(hits):
                assert model.kv[b * block_size:(b + 1) * block_size] == truth[seq.request_id][
                    i * block_size:(i + 1) * block_size]
            cached = len(hits) * block_size
            n = data.draw(st.integers(1, seq.num_tokens - cached), label="chunk")
            can = bm.can_admit(seq, hits, cached + n)
            assert can == model.can_admit(hits, cached + n)
            if can:
                bm.admit(seq, hits, cached + n)
                model.admit(seq.request_id, hits, cached + n)
                assert seq.num_computed_tokens == cached
                waiting.remove(seq)
                running.append(seq)
        elif op == "compute":
            seq = running[data.draw(st.integers(0, len(running) - 1), label="which")]
            if seq.num_computed_tokens == seq.num_tokens:
                continue
            end = seq.num_computed_tokens + data.draw(st.integers(1, seq.num_uncomputed_tokens), label="chunk")
            if not bm.can_grow(seq, end):
                continue
            bm.grow(seq, end)
            model.grow(seq.request_id, end)
            for p in range(seq.num_computed_tokens, end):
                b = seq.block_table[p // block_size]
                assert bm.ref_count(b) == 1, f"{seq.request_id} writes block {b}, which others hold"
                model.kv[b * block_size + p % block_size] = truth[seq.request_id][p]
            seq.num_computed_tokens = end
            bm.cache_blocks(seq)
            model.cache_blocks(seq.request_id, known_tokens(seq), end)
        elif op == "sample":
            seq = data.draw(st.sampled_from([s for s in running
                                             if s.num_computed_tokens == s.num_tokens and not s.num_pending]))
            if -(-(seq.num_tokens + 1) // block_size) > num_blocks:
                continue
            seq.num_pending = 1
            truth[seq.request_id].append(data.draw(st.integers(1, 2), label="token"))
        elif op == "receive":
            seq = data.draw(st.sampled_from([s for s in running + waiting if s.num_pending]))
            seq.num_pending = 0
            seq.output_token_ids.append(truth[seq.request_id][-1])
        elif op in ("finish", "preempt"):
            seq = running.pop(data.draw(st.integers(0, len(running) - 1), label="which"))
            model.free_blocks(seq.request_id, known_tokens(seq), seq.num_computed_tokens)
            bm.free(seq)
            if op == "preempt":  # back to waiting, its tokens (a pending one too) kept
                seq.num_computed_tokens = 0
                waiting.insert(0, seq)
        else:
            assert bm.reset() == model.reset()
        check()


# ---------------------------------------------------------------------------- the engine on the fake model
BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make_engine(caching: bool, budget: int = 8, block_size: int = 4, num_blocks: int = 256, max_model_len: int = 64,
                max_num_seqs: int = 8, async_scheduling: bool = False, group=None, rank: int = 0,
                num_ranks: int = 1, scheduling_policy: str = "fcfs") -> LLMEngine:
    return LLMEngine(FakeModel(budget, group), TOK, num_blocks=num_blocks, block_size=block_size,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_tokens_per_rank=budget,
                     device=torch.device("cpu"), rank=rank, num_ranks=num_ranks, async_scheduling=async_scheduling,
                     enable_prefix_caching=caching, scheduling_policy=scheduling_policy)


def computed_tokens(engine: LLMEngine) -> int:
    """Tokens the model has computed so far (every forward's)."""
    return sum(n for _, n in engine.model.batches)


def check_cache(engine: LLMEngine) -> None:
    """Each block is held by as many running sequences as list it, and the rest are free; on the fake model
    (which stores token id + 1 per slot) every computed token of a running sequence whose id the host
    knows sits in its KV slot, whoever computed it."""
    bm = engine.block_manager
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
        if isinstance(engine.model, FakeModel):
            known = seq.prompt_token_ids + seq.output_token_ids
            for p in range(min(seq.num_computed_tokens, len(known))):
                slot = slot_of(seq.block_table, p, bm.block_size)
                assert int(engine.model.kv[slot]) == known[p] + 1, (seq.request_id, p)
    assert all(bm.ref_count(b) == holders.get(b, 0) for b in range(bm.num_blocks))
    assert bm.num_free_blocks + len(holders) == bm.num_blocks
    assert engine.scheduler_stats().kv_cache_usage == pytest.approx(len(holders) / bm.num_blocks)


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0  # under the priority scheduling policy


def workload(rng: random.Random, n: int, sampled: bool = False, window: int = 30) -> list[Arrival]:
    """n requests over three shared prefixes (2 to 6 blocks of 4, cut at random places) with their own
    tails, arriving over 30 steps; greedy, or seeded sampling."""
    bases = [[rng.randint(1, 40) for _ in range(rng.randint(8, 24))] for _ in range(3)]
    arrivals = []
    for i in range(n):
        base = bases[i % 3]
        prompt = base[:rng.randint(len(base) // 2, len(base))] + [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
        max_tokens = rng.randint(1, 12)
        params = (SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=rng.randint(0, 1000),
                                 ignore_eos=True) if sampled else
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        arrivals.append(Arrival(0 if i < 3 else rng.randint(1, window), f"r{i}", prompt, params))
    return arrivals


def drive(engine: LLMEngine, arrivals: list[Arrival], aborts: dict[int, list[str]] | None = None,
          sync: StepSync | None = None, last_step: int = 0) -> dict[str, list[RequestOutput]]:
    """Add the requests at their steps, abort some at theirs, step until everything is done (with peers:
    until no rank steps, after last_step); every output by request. The cache is checked after each step.
    With peers the steps are the agreed ones: a call that only hands out pending outputs does not agree
    (async scheduling before a prompt step, LLMEngine.flush_if_prompt_next), and counted as a step it would
    put one rank's arrivals and end at another agreement than its peer's, which then waits for it forever."""
    outs: dict[str, list[RequestOutput]] = {a.request_id: [] for a in arrivals}
    last_step = max([last_step, *(a.step for a in arrivals), *(aborts or {})])
    step, started = 0, -1
    for _ in range(5000):
        if step != started:
            started = step
            for a in arrivals:
                if a.step == step:
                    engine.add_request(a.request_id, a.prompt, a.params, a.priority)
            for rid in (aborts or {}).get(step, ()):
                out = engine.abort(rid)
                if out is not None:
                    outs[rid].append(out)
        agreed = sync.plan if sync is not None else None
        for out in engine.step(sync):
            outs[out.request_id].append(out)
        check_cache(engine)
        if sync is not None and sync.plan is agreed:  # no agreement: pending outputs handed out, nothing run
            continue
        if step >= last_step and not engine.has_work() and (sync is None or not sync.plan.step):
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            return outs
        step += 1
    raise AssertionError("not done after 5000 calls")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    return {rid: (tokens(o), "".join(x.new_text for x in o), o[-1].finish_reason if o else None)
            for rid, o in outs.items()}


SCENARIOS = {  # name: make_engine's arguments
    "chunked": dict(budget=8, num_blocks=256, max_num_seqs=8),
    "mixed-wide": dict(budget=32, num_blocks=256, max_num_seqs=4),
    "preempting": dict(budget=8, num_blocks=16, max_num_seqs=8),
}
# In the preempting scenario: two requests of 9 blocks each (their own tokens), which 16 blocks cannot hold.
HEAVY = [Arrival(0, f"heavy{i}", [41 + (i + 3 * j) % 19 for j in range(24)],
                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(2)]


@BOTH_MODES
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_outputs_are_the_same_with_caching_on_and_off(scenario: str, async_scheduling: bool, seed: int):
    rng = random.Random(seed)
    arrivals = workload(rng, 12, window=10 if scenario == "preempting" else 30)
    arrivals += HEAVY if scenario == "preempting" else []
    aborts: dict[int, list[str]] = {}
    for a in rng.sample(arrivals[:12], 2):
        aborts.setdefault(a.step + rng.randint(0, 6), []).append(a.request_id)
    aborted = {rid for rids in aborts.values() for rid in rids}
    runs = {}
    for caching in (False, True):
        engine = make_engine(caching, async_scheduling=async_scheduling, **SCENARIOS[scenario])
        runs[caching] = summary(drive(engine, arrivals, aborts)), engine
    (off, off_engine), (on, on_engine) = runs[False], runs[True]
    for a in arrivals:
        want = reference_greedy(a.prompt, a.params.max_tokens, ignore_eos=True)
        if a.request_id in aborted:  # how far it got before its abort depends on the timing
            for got in (on, off):
                assert want[:len(got[a.request_id][0])] == got[a.request_id][0], (seed, a.request_id)
        else:
            assert on[a.request_id] == off[a.request_id], (seed, a.request_id)
            assert on[a.request_id][0] == want and on[a.request_id][2] == "length", (seed, a.request_id)
    stats = on_engine.scheduler_stats()
    assert stats.prefix_cache_hits > 0 and computed_tokens(on_engine) < computed_tokens(off_engine), seed
    assert off_engine.scheduler_stats().prefix_cache_queries == 0
    if scenario == "preempting":
        assert on_engine.scheduler.num_preemptions > 0, seed


@BOTH_MODES
def test_priority_scheduling_keeps_the_outputs_and_the_cache_right(async_scheduling: bool, seed: int):
    """The preempting scenario under the priority policy, with random priorities: every request still gets the
    reference's tokens, caching on or off, the cache adds up after every step (drive), and preemptions happen."""
    rng = random.Random(seed)
    arrivals = [replace(a, priority=rng.randint(-3, 3))
                for a in workload(rng, 12, window=10) + HEAVY]
    for caching in (False, True):
        engine = make_engine(caching, async_scheduling=async_scheduling, scheduling_policy="priority",
                             **SCENARIOS["preempting"])
        got = summary(drive(engine, arrivals))
        for a in arrivals:
            want = reference_greedy(a.prompt, a.params.max_tokens, ignore_eos=True)
            assert got[a.request_id][0] == want and got[a.request_id][2] == "length", (seed, caching, a.request_id)
        assert engine.scheduler.num_preemptions > 0, seed


@BOTH_MODES
def test_seeded_sampling_is_the_same_with_caching_on_and_off(async_scheduling: bool, seed: int):
    arrivals = workload(random.Random(seed), 12, sampled=True)
    runs = []
    for caching in (False, True):
        engine = make_engine(caching, async_scheduling=async_scheduling, num_blocks=24)
        runs.append(summary(drive(engine, arrivals)))
    assert runs[0] == runs[1], seed
    assert engine.scheduler_stats().prefix_cache_hits > 0


@BOTH_MODES
def test_a_request_sharing_a_long_prefix_computes_only_its_tail(async_scheduling: bool):
    prefix = [1 + (7 * i) % 37 for i in range(60)]  # 15 blocks of 4
    for caching in (False, True):
        engine = make_engine(caching, async_scheduling=async_scheduling, max_model_len=96)
        first = drive(engine, [Arrival(0, "first", prefix, SamplingParams(max_tokens=1, temperature=0.0))])
        before = computed_tokens(engine)
        second = drive(engine, [Arrival(0, "second", [*prefix, 5, 9, 2, 8, 3],
                                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
        # The tail's 5 tokens, then a decode token for each of the 5 tokens after the first.
        assert computed_tokens(engine) - before == (5 if caching else 65) + 5
        assert tokens(second["second"]) == reference_greedy([*prefix, 5, 9, 2, 8, 3], 6, ignore_eos=True)
        assert tokens(first["first"]) == reference_greedy(prefix, 1, ignore_eos=True)
        stats = engine.scheduler_stats()
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == ((60 + 65, 60) if caching else (0, 0))


@BOTH_MODES
def test_a_cache_salt_shares_blocks_only_among_requests_of_that_salt(async_scheduling: bool):
    """vLLM's cache_salt: the same prompt hits the cache under the same salt only (none, "a", "b", "a", none)."""
    prompt = [1 + (5 * i) % 31 for i in range(40)]  # 10 blocks of 4
    engine = make_engine(True, async_scheduling=async_scheduling, max_model_len=64)
    cached = []
    for i, salt in enumerate([None, "a", "b", "a", None]):
        before = computed_tokens(engine)
        out = drive(engine, [Arrival(0, f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                       cache_salt=salt))])
        assert tokens(out[f"r{i}"]) == reference_greedy(prompt, 1, ignore_eos=True)
        cached.append(computed_tokens(engine) - before)
    assert cached == [40, 40, 40, 4, 4]  # a hit computes the last block only (the prompt's last token is computed)


@BOTH_MODES
def test_generated_tokens_are_cached_too(async_scheduling: bool):
    """A follow-up whose prompt is an earlier request's prompt and completion (a chat's next turn) starts
    after the blocks that completion filled."""
    engine = make_engine(True, async_scheduling=async_scheduling)
    prompt = [3, 1, 4, 1, 5, 9]
    first = tokens(drive(engine, [Arrival(0, "turn1", prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True))])["turn1"])
    turn2 = prompt + first + [2, 6]  # 16 tokens: the first turn computed 13 of them (its last token never)
    before = computed_tokens(engine)
    outs = drive(engine, [Arrival(0, "turn2", turn2, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))])
    assert tokens(outs["turn2"]) == reference_greedy(turn2, 2, ignore_eos=True)
    assert engine.scheduler_stats().prefix_cache_hits == 12  # 3 full blocks of the 13 computed tokens
    assert computed_tokens(engine) - before == 4 + 1


@BOTH_MODES
def test_a_preempted_sequence_comes_back_on_its_cached_blocks(async_scheduling: bool):
    """Two long sequences in 12 blocks: one is preempted; when it is admitted again, the blocks it freed
    are still cached, so it recomputes less than its tokens."""
    engine = make_engine(True, async_scheduling=async_scheduling, num_blocks=12, max_model_len=48)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    arrivals = [Arrival(0, f"r{i}", [1 + (5 * j + 11 * i) % 37 for j in range(20)], params) for i in range(2)]
    admitted: list[tuple[str, int, int]] = []
    admit = engine.block_manager.admit

    def spy(seq: Sequence, hits: list[int], num_tokens: int) -> None:
        admitted.append((seq.request_id, seq.num_tokens, len(hits)))
        admit(seq, hits, num_tokens)

    engine.block_manager.admit = spy
    outs = drive(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0
    for a in arrivals:
        assert tokens(outs[a.request_id]) == reference_greedy(a.prompt, 20, ignore_eos=True)
    comebacks = [hits for rid, n, hits in admitted[2:]]
    assert comebacks and max(comebacks) > 0, admitted
    assert engine.scheduler_stats().prefix_cache_queries == 40  # a comeback's look is not a new query


@BOTH_MODES
def test_prompt_logprobs_are_the_same_with_caching_on_and_off(async_scheduling: bool):
    """A request for prompt logprobs behind a cached prefix computes its whole prompt (it does not read
    the cache, nor count as a query) and gets what it gets without caching; its blocks are cached for the
    next request."""
    prefix = [2 + (3 * i) % 29 for i in range(13)]
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    runs = {}
    for caching in (False, True):
        engine = make_engine(caching, async_scheduling=async_scheduling)
        drive(engine, [Arrival(0, "warm", [*prefix, 7], SamplingParams(max_tokens=3, temperature=0.0))])
        queried = engine.scheduler_stats().prefix_cache_queries
        before = computed_tokens(engine)
        outs = drive(engine, [Arrival(0, "scored", [*prefix, 9, 4, 8], scored)])
        assert computed_tokens(engine) - before == 16 + 3
        assert engine.scheduler_stats().prefix_cache_queries == queried
        first = next(o for o in outs["scored"] if o.new_token_ids)
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 16
        runs[caching] = ([o.prompt_logprobs for o in outs["scored"]], [o.logprobs for o in outs["scored"]],
                         tokens(outs["scored"]))
        follow = drive(engine, [Arrival(0, "next", [*prefix, 9, 4, 8, 1], SamplingParams(max_tokens=1))])
        assert follow["next"][-1].finish_reason == "length"
        assert engine.scheduler_stats().prefix_cache_hits == (16 if caching else 0)  # the scored request's blocks
    assert runs[True] == runs[False]
    assert runs[True][2] == reference_greedy([*prefix, 9, 4, 8], 4, ignore_eos=True)


def _ep_rank(rank: int, world_size: int, async_scheduling: bool, seed: int) -> dict:
    import torch.distributed as dist

    sync = StepSync(dist.new_group(backend="gloo"))
    workloads = [workload(random.Random(seed * 10 + r), 8) for r in range(world_size)]
    last_step = max(a.step for w in workloads for a in w)
    runs = {}
    for caching in (False, True):
        engine = make_engine(caching, group=dist.group.WORLD, rank=rank, num_ranks=world_size,
                             async_scheduling=async_scheduling, num_blocks=32)
        outs = drive(engine, workloads[rank], sync=sync, last_step=last_step)
        runs[caching] = {"outs": summary(outs), "computed": computed_tokens(engine),
                         "hits": engine.scheduler_stats().prefix_cache_hits, "forwards": engine.model.num_forwards}
    runs["want"] = {a.request_id: reference_greedy(a.prompt, a.params.max_tokens, ignore_eos=True)
                    for a in workloads[rank]}
    return runs


@BOTH_MODES
def test_expert_parallel_ranks_keep_their_own_caches(async_scheduling: bool, seed: int):
    """Two ranks step together (FakeModel checks every forward lines up), each with its own requests
    and cache: the same tokens with caching on and off, equal to the reference, with hits on each rank."""
    results = run_ranks(_ep_rank, 2, async_scheduling, seed, timeout_s=120)
    for rank, r in enumerate(results):
        assert r[True]["outs"] == r[False]["outs"], (seed, rank)
        assert {rid: got[0] for rid, got in r[True]["outs"].items()} == r["want"], (seed, rank)
        assert r[True]["hits"] > 0 and r[True]["computed"] < r[False]["computed"], (seed, rank)
    assert results[0][True]["forwards"] == results[1][True]["forwards"]


# ---------------------------------------------------------------------------- the tiny DeepSeek-V3
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from serving.tiny_model import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


def tiny_engine(path: str, device: str, caching: bool, use_cuda_graphs: bool = False, backend: str = "reference",
                async_scheduling: bool = False) -> LLMEngine:
    from serving.loading.checkpoint import load_checkpoint, read_tokenizer

    model = load_checkpoint(path, backend=backend, max_tokens_per_rank=32, dtype=torch.float32, device=device,
                       progress=False)
    return LLMEngine(model, read_tokenizer(path), num_blocks=96, block_size=4, max_model_len=128, max_num_seqs=8,
                     max_tokens_per_rank=32, device=torch.device(device), use_cuda_graphs=use_cuda_graphs,
                     async_scheduling=async_scheduling, enable_prefix_caching=caching)


def shared_prefix_requests(engine: LLMEngine) -> tuple[dict[str, tuple[list[int], list[list[float]]]], list[bool]]:
    """Four requests over one 44-token prefix (11 blocks of 4): one first, then one whose tail is a single
    token, alone (with caching its first step computes that token only: a decode-shaped step), then two
    together (tails of 3 and 6 tokens); greedy with the top 3 logprobs of each token. Each one's tokens
    and those logprobs, and for each step that computed the one-token request's prompt, whether it ran
    as a decode step (a graph replay where graphs are captured)."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 500, (44,), generator=gen).tolist()
    tails = {"first": [7, 8], "one": [11], "three": [12, 13, 14], "six": [15, 16, 17, 18, 19, 20]}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    one_prompt_steps: list[bool] = []
    execute = engine.runner.execute

    def spy(batch, graph_size=None, pending_tokens=None, moe_mode="low_latency"):
        if any(s.request_id == "one" and s.num_computed_tokens < s.num_prompt_tokens for s in batch.seqs):
            replayed = graph_size is not None or not engine.runner.captured_sizes
            one_prompt_steps.append(batch.is_decode_only and replayed)
        return execute(batch, graph_size, pending_tokens, moe_mode)

    engine.runner.execute = spy
    got: dict[str, tuple[list[int], list[list[float]]]] = {}
    for group in (["first"], ["one"], ["three", "six"]):
        outs = drive(engine, [Arrival(0, rid, prefix + tails[rid], params) for rid in group])
        for rid, o in outs.items():
            got[rid] = tokens(o), [[lp for _, lp in entry.top] for out in o for entry in out.logprobs or ()]
    return got, one_prompt_steps


def test_tiny_model_attends_over_a_cached_prefix(tiny_path: str):
    """The MLA attention of prompts that start after 44 cached tokens (paged KV written by another
    request; one of them in a decode-shaped step) gives the tokens, and within batching's noise the
    logprobs, of prompts computed in full."""
    runs = {}
    for caching in (False, True):
        engine = tiny_engine(tiny_path, "cpu", caching)
        runs[caching], one_prompt_steps = shared_prefix_requests(engine)
        assert (one_prompt_steps == [True]) if caching else not any(one_prompt_steps)
        assert engine.scheduler_stats().prefix_cache_hits == (3 * 44 if caching else 0)
    for rid, (want_tokens, want_logprobs) in runs[False].items():
        got_tokens, got_logprobs = runs[True][rid]
        assert got_tokens == want_tokens, rid
        # Not bit for bit: the MoE layers compute in bf16, and which rows share a step moves a logprob by
        # 2.4e-3 here with caching off too (three requests together, or each alone). A wrong position or
        # block moves them by far more.
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_caching_with_step_cuda_graphs_on_gpu(tiny_path: str, async_scheduling: bool):
    """On the GPU with step CUDA graphs (replayed for every step; decode-shaped for the first step of the request
    whose prompt is one token past 44 cached ones): the tokens of an engine without caching, logprobs
    within the graphs' tolerance (tests/test_serving_graphs.py), and the hits."""
    from ep_layer import native

    if not native.available():
        pytest.skip("the cuda backend is not built")
    runs = {}
    for caching in (False, True):
        engine = tiny_engine(tiny_path, "cuda", caching, use_cuda_graphs=True, backend="cuda",
                             async_scheduling=async_scheduling)
        assert engine.runner.captured_sizes, engine.runner.eager_reason
        runs[caching], one_prompt_steps = shared_prefix_requests(engine)
        assert (one_prompt_steps == [True]) if caching else not any(one_prompt_steps)  # with caching: a replay
        assert engine.scheduler_stats().prefix_cache_hits == (3 * 44 if caching else 0)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        del engine
    for rid, (want_tokens, want_logprobs) in runs[False].items():
        got_tokens, got_logprobs = runs[True][rid]
        # The cached prefix's KV was written by another request's prefill, in another batch; a bf16 GEMM's
        # tiles follow its row count, so the KV may differ in its last bits and a near-tie between the
        # two likeliest tokens may flip. Greedy tokens agree up to the first flip, which must be such a
        # tie (the two likeliest within the tolerance), and the logprobs agree up to it.
        same = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens)) if a != b), len(want_tokens))
        if same < len(want_tokens):
            top = want_logprobs[same]
            assert top[0] - top[1] < 3e-2, (rid, same, top)
        torch.testing.assert_close(torch.tensor(got_logprobs[:same + 1]), torch.tensor(want_logprobs[:same + 1]),
                                   rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("caching", [True, False])
def test_a_requests_first_output_says_how_many_prompt_tokens_the_cache_held(caching: bool, seed: int):
    """Each request's first output carries its prompt tokens found in the prefix cache (later outputs none): whole
    blocks, never the whole prompt, none with caching off; and the fake model computed exactly the rest of each
    prompt, plus one token per output but the last (no preemption in this scenario)."""
    engine = make_engine(caching, **SCENARIOS["chunked"])
    arrivals = workload(random.Random(seed), 24)
    outs = drive(engine, arrivals)
    prompts = {a.request_id: len(a.prompt) for a in arrivals}
    cached = {}
    for rid, out in outs.items():
        first = next(i for i, o in enumerate(out) if o.new_token_ids)
        assert all(o.num_cached_tokens is None for i, o in enumerate(out) if i != first)
        cached[rid] = out[first].num_cached_tokens
        assert cached[rid] % 4 == 0 and 0 <= cached[rid] < prompts[rid]
    assert computed_tokens(engine) == sum(prompts[r] - cached[r] + len(tokens(outs[r])) - 1 for r in outs)
    assert (sum(cached.values()) > 0) == caching
