"""serving.engine.warm_up against the fake model (tests/serving_fakes.py): the warm-up requests take every
sampler path, leave the engine as a fresh one (no request, no block held or cached, no counters), and
expert-parallel ranks run them in step (FakeModel checks every forward lines up)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from serving_fakes import reference_greedy
from test_serving_engine import GREEDY, greedy_in_step, make_engine, tokens

from serving.engine import warm_up
from serving.engine.engine import LLMEngine
from serving.engine.messages import RequestOutput
from serving.engine.step_sync import StepSync


def test_warm_up_leaves_a_fresh_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(budget=16, max_num_seqs=8, async_scheduling=True)
    sampled = []
    run = engine.sampler.run

    def spy(logits, params, generators, history=None, banned=None):
        sampled.extend((p, history is not None, banned is not None) for p in params)
        return run(logits, params, generators, history, banned)

    monkeypatch.setattr(engine.sampler, "run", spy)
    step_tokens = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda batch: step_tokens.append(batch.num_tokens) or forward(batch))
    seconds = warm_up.warm_up(engine)
    assert seconds > 0 and not engine.has_work() and not engine.requests
    lengths = warm_up.PROMPT_LENGTHS
    # And two prompts that fill a step each (no graphs on CPU: steps run eagerly), alone: 16 tokens and 15.
    assert len(sampled) == (len(lengths) * len(warm_up.PARAMS) + 2) * warm_up.MAX_TOKENS
    assert warm_up.eager_step_lengths(engine) == [16, 15] and {16, 15} <= set(step_tokens)
    assert {p for p, _, _ in sampled} == set(warm_up.PARAMS)
    assert any(penalized for _, penalized, _ in sampled) and any(banned for _, _, banned in sampled)
    assert engine.model.max_batch_tokens == engine.scheduler.token_budget and engine.model.num_forwards > len(lengths)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.reset()
    stats = engine.scheduler_stats()
    assert (stats.num_running, stats.num_waiting, stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0, 0, 0)
    counters = engine.ep_stats().steps
    assert set(counters.count.values()) == {0} and set(counters.seconds.values()) == {0}
    assert (set(counters.tokens_per_bucket), counters.tokens_sum) == ({0}, 0)
    # A warm-up prompt again: computed in full (nothing cached), and served as by a fresh engine.
    prompt = warm_up.prompt_of(engine, lengths[-1])
    fresh = make_engine(budget=16, max_num_seqs=8, async_scheduling=True)
    got = {}
    for name, e in (("warm", engine), ("fresh", fresh)):
        e.add_request("again", prompt, GREEDY)
        got[name] = tokens(drain(e))
    assert got["warm"] == got["fresh"] == reference_greedy(prompt, 12, ignore_eos=True)
    assert engine.scheduler_stats().prefix_cache_hits == 0


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(500):
        if not engine.has_work():
            return outs
        outs += engine.step()
    raise AssertionError("not finished after 500 steps")


def _warm_up_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    sync = StepSync(dist.new_group(backend="gloo"))
    engine = make_engine(budget=16, group=dist.group.WORLD, rank=rank, num_ranks=world_size)
    warm_up.warm_up(engine, sync)
    forwards = engine.model.num_forwards
    ok = greedy_in_step(engine, sync, rank, {0: [3, 20], 1: [5]}[rank])
    return {"ok": ok, "warm_up_forwards": forwards}


def test_expert_parallel_ranks_warm_up_together() -> None:
    results = run_ranks(_warm_up_rank, 2, timeout_s=60)
    assert all(r["ok"] for r in results), results
    assert results[0]["warm_up_forwards"] == results[1]["warm_up_forwards"] > 0


def test_an_eager_step_out_of_memory_names_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up eager step that runs out of GPU memory (the KV cache was sized before any step that long ran)
    fails start-up with the two flags that make room, not a bare allocator error."""
    engine = make_engine(budget=16, max_num_seqs=8)
    step = engine.step

    def short_of_memory(sync=None):
        if any(name.startswith("warm-up-eager") for name in engine.requests):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(sync)

    monkeypatch.setattr(engine, "step", short_of_memory)
    with pytest.raises(RuntimeError, match=r"warm-up: a step of 16 tokens ran out of GPU memory; lower "
                                           r"--max-num-batched-tokens \(the step budget, 16 tokens\) or "
                                           r"--gpu-memory-utilization .*Tried to allocate 2.00 GiB"):
        warm_up.warm_up(engine)
