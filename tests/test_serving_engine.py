"""serving.engine against the fake model (tests/serving_fakes.py), whose logits come from the tokens it
reads back through the block tables: scheduling, chunked prefill, paged KV blocks, preemption, stop
conditions, streaming text, seeded sampling, cancellation, and ranks stepping together (EP); each with
and without async scheduling (a step's tokens read on the device by the next step)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_ranks
from serving_fakes import EOS, VOCAB, FakeModel, FakeTokenizer, reference_greedy

from serving.engine.detokenizer import IncrementalDetokenizer, OutputText
from serving.engine.engine import LLMEngine
from serving.engine.messages import RequestOutput
from serving.engine.sampling import Sampler
from serving.engine.sequence import SamplingParams
from serving.engine.step_sync import StepSync

TOK = FakeTokenizer()
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make_engine(budget: int = 8, block_size: int = 4, num_blocks: int = 256, max_model_len: int = 128,
                max_num_seqs: int = 8, eos_bias: float = -4.0, group=None, rank: int = 0,
                num_ranks: int = 1, async_scheduling: bool = False, token_budget: int | None = None,
                deepep_mode: str = "low_latency", long_prefill_token_threshold: int = 0,
                scheduling_policy: str = "fcfs") -> LLMEngine:
    """budget: the low-latency T; token_budget: the tokens a step may hold (None: T)."""
    model = FakeModel(budget, group, eos_bias)
    return LLMEngine(model, TOK, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs, max_tokens_per_rank=budget, device=torch.device("cpu"),
                     rank=rank, num_ranks=num_ranks, async_scheduling=async_scheduling, token_budget=token_budget,
                     deepep_mode=deepep_mode, long_prefill_token_threshold=long_prefill_token_threshold,
                     scheduling_policy=scheduling_policy)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [1 + (7 * i + 3 * salt) % 30 for i in range(n)]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    """Add the requests, step until all finish; every output by request."""
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for out in engine.step():
            outs[out.request_id].append(out)
    raise AssertionError(f"not finished after {max_steps} steps")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def check_blocks(engine: LLMEngine) -> None:
    """Every running sequence holds exactly the blocks its computed tokens need, each block counted once
    per holder (the prefix cache shares blocks); the rest are free."""
    bm = engine.block_manager
    held: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            held[b] = held.get(b, 0) + 1
    assert all(bm.ref_count(b) == n for b, n in held.items())
    for seq in engine.scheduler.running:
        assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / bm.block_size)
    for seq in engine.scheduler.waiting:
        assert seq.block_table == []
    assert bm.num_free_blocks + len(held) == bm.num_blocks
    assert engine.scheduler_stats().kv_cache_usage == pytest.approx(len(held) / bm.num_blocks)


# ---------------------------------------------------------------------------- batching and the KV cache
@BOTH_MODES
def test_greedy_matches_reference_with_chunked_prefill_and_mixed_batches(async_scheduling: bool):
    engine = make_engine(budget=8, async_scheduling=async_scheduling)
    lengths = [14, 12, 12]
    requests = {f"r{n}": (prompt_of(n, n), GREEDY) for n in lengths}
    outs = run(engine, requests)
    for rid, (prompt, _) in requests.items():
        assert tokens(outs[rid]) == reference_greedy(prompt, 12, ignore_eos=True), rid
        assert text(outs[rid]) == TOK.decode(reference_greedy(prompt, 12, ignore_eos=True)), rid
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].num_output_tokens == 12
    assert engine.model.max_batch_tokens == 8  # the budget was used to the full, never exceeded
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chunked_prefill_steps_and_decode_alongside():
    engine = make_engine(budget=8)
    engine.add_request("short", prompt_of(3), GREEDY)
    assert [o.request_id for o in engine.step()] == ["short"]  # 3-token prefill, first token sampled
    engine.add_request("long", prompt_of(20, 1), GREEDY)
    steps = [engine.step() for _ in range(4)]
    # short decodes one token per step while long's prompt goes in chunks of 7, 7, 6 (budget 8 minus 1).
    assert engine.model.batches[1:] == [(2, 8), (2, 8), (2, 7), (2, 2)]
    assert [[o.request_id for o in s] for s in steps] == [["short"], ["short"], ["short", "long"], ["short", "long"]]
    check_blocks(engine)


@BOTH_MODES
def test_long_prefill_token_threshold_caps_each_sequences_chunk(async_scheduling: bool):
    """vLLM's --long-prefill-token-threshold: prompts beside a decoding sequence go in chunks of at most 3
    tokens each (two of them sharing a step), and every output is the reference's."""
    engine = make_engine(budget=8, async_scheduling=async_scheduling, long_prefill_token_threshold=3)
    steps: list[dict[str, int]] = []
    execute = engine.runner.execute

    def recorded(batch, *args, **kwargs):
        steps.append({seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)})
        return execute(batch, *args, **kwargs)

    engine.runner.execute = recorded
    engine.add_request("short", prompt_of(3), GREEDY)
    got: dict[str, list[int]] = {"short": [], "long": [], "other": []}
    for out in engine.step():  # short's prompt: 3 tokens, within the cap
        got[out.request_id] += out.new_token_ids
    engine.add_request("long", prompt_of(10, 1), GREEDY)
    engine.add_request("other", prompt_of(5, 2), GREEDY)
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert all(n <= 3 for step in steps for n in step.values()), steps
    assert {"short": 1, "long": 3, "other": 3} in steps, steps  # a decode beside two capped chunks
    assert [step.get("long") for step in steps if step.get("long", 1) > 1] == [3, 3, 3], steps
    for rid, prompt in (("short", prompt_of(3)), ("long", prompt_of(10, 1)), ("other", prompt_of(5, 2))):
        assert got[rid] == reference_greedy(prompt, 12, ignore_eos=True), rid
    check_blocks(engine)


def test_long_prefill_token_threshold_keeps_the_outputs():
    requests = {f"r{n}": (prompt_of(n, n), GREEDY) for n in (1, 9, 17, 30)}
    for threshold in (0, 2, 5):
        outs = run(make_engine(budget=8, long_prefill_token_threshold=threshold), requests)
        for rid, (prompt, _) in requests.items():
            assert tokens(outs[rid]) == reference_greedy(prompt, 12, ignore_eos=True), (threshold, rid)


@BOTH_MODES
def test_block_accounting_through_a_run(async_scheduling: bool):
    engine = make_engine(budget=8, block_size=4, async_scheduling=async_scheduling)
    for i, n in enumerate([3, 10, 4, 21]):
        engine.add_request(f"r{i}", prompt_of(n, i), SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True))
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
        check_blocks(engine)
    assert not engine.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.block_manager.usage == 0.0


@BOTH_MODES
def test_preemption_when_the_cache_runs_out_recomputes_correctly(async_scheduling: bool):
    # 3 sequences of up to 40 tokens, blocks of 4: 30 blocks needed, 12 available (one full sequence fits).
    engine = make_engine(budget=8, block_size=4, num_blocks=12, max_model_len=48, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    requests = {f"r{i}": (prompt_of(20, i), params) for i in range(3)}
    outs = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, (prompt, _) in requests.items():
        assert tokens(outs[rid]) == reference_greedy(prompt, 20, ignore_eos=True), rid
    assert engine.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_requests_start_by_arrival_or_by_priority_then_arrival(policy: str):
    """One sequence at a time: requests start (their first token out) in arrival order under fcfs, and under
    priority by their priority (smaller first), then arrival (vLLM's PriorityRequestQueue); tokens as the
    reference's."""
    engine = make_engine(max_num_seqs=1, scheduling_policy=policy)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    priorities = {"r0": 5, "r1": 1, "r2": 1, "r3": -2, "r4": 5}
    for i, (rid, priority) in enumerate(priorities.items()):
        engine.add_request(rid, prompt_of(3, i), params, priority=priority if policy == "priority" else 0)
    started, outs = [], {rid: [] for rid in priorities}
    while engine.has_work():
        for out in engine.step():
            if not outs[out.request_id]:
                started.append(out.request_id)
            outs[out.request_id].append(out)
    assert started == (["r3", "r1", "r2", "r0", "r4"] if policy == "priority" else list(priorities))
    for i, rid in enumerate(priorities):
        assert tokens(outs[rid]) == reference_greedy(prompt_of(3, i), 3, ignore_eos=True), rid


@BOTH_MODES
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_newest_or_the_lowest_priority(policy: str, async_scheduling: bool):
    """The KV cache holds one long sequence: the first preempted is the newest running one under fcfs, and under
    priority the one of lowest priority, here the oldest, running first, which the step had already scheduled
    when a later one could not grow (its tokens go back to the budget). Every sequence still gets the
    reference's tokens, and the blocks add up each step."""
    engine = make_engine(budget=8, block_size=4, num_blocks=12, max_model_len=48, async_scheduling=async_scheduling,
                         scheduling_policy=policy)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    priorities = {"r0": 9, "r1": 0, "r2": 0}
    lengths = {"r0": 10, "r1": 12, "r2": 12}  # r0 grows a block in other steps than the others
    for i, (rid, priority) in enumerate(priorities.items()):
        engine.add_request(rid, prompt_of(lengths[rid], i), params, priority=priority if policy == "priority" else 0)
        if rid == "r0":
            engine.step()  # r0 runs first
    preempted: list[str] = []
    real_preempt = engine.scheduler._preempt

    def recorded(seq) -> None:
        preempted.append(seq.request_id)
        real_preempt(seq)

    engine.scheduler._preempt = recorded
    outs = {rid: [] for rid in priorities}
    for _ in range(500):
        if not engine.has_work():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
        check_blocks(engine)
    assert preempted and preempted[0] == ("r0" if policy == "priority" else "r2"), preempted
    for i, rid in enumerate(priorities):
        assert tokens(outs[rid]) == reference_greedy(prompt_of(lengths[rid], i), 20, ignore_eos=True), rid


def test_a_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="priority: 3 needs the priority scheduling policy"):
        make_engine().add_request("r", prompt_of(3), GREEDY, priority=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_engine(scheduling_policy="lifo")


@BOTH_MODES
def test_generate_runs_prompts_to_completion(async_scheduling: bool):
    prompts = [prompt_of(4, 1), prompt_of(11, 2)]
    want = [TOK.decode(reference_greedy(p, 12, ignore_eos=True)) for p in prompts]
    assert make_engine(async_scheduling=async_scheduling).generate(prompts, GREEDY) == want


def test_max_num_seqs_bounds_the_running_set():
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", prompt_of(2, i), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.step()
    stats = engine.scheduler_stats()
    assert (stats.num_running, stats.num_waiting) == (2, 3)


@BOTH_MODES
def test_a_sequence_stops_at_max_model_len(async_scheduling: bool):
    engine = make_engine(max_model_len=16, async_scheduling=async_scheduling)
    outs = run(engine, {"r": (prompt_of(10), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))})
    assert len(tokens(outs["r"])) == 6 and outs["r"][-1].finish_reason == "length"


def test_add_request_refuses_bad_prompts():
    engine = make_engine(max_model_len=16)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("b", [1, VOCAB], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("c", prompt_of(16), GREEDY)
    engine.add_request("d", [1], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("d", [1], GREEDY)


# ---------------------------------------------------------------------------- stop conditions and text
def greedy_text(prompt: list[int], n: int = 40) -> str:
    return TOK.decode(reference_greedy(prompt, n, ignore_eos=True))


@BOTH_MODES
def test_stop_string_trims_output_and_streaming_never_shows_it(async_scheduling: bool):
    prompt = prompt_of(6, 2)
    full = greedy_text(prompt)
    stop = full[15:18]
    cut = full.find(stop)
    assert cut > 0, "pick another prompt: the stop string must not start the text"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=("never there", stop))
    outs = run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, params)})["r"]
    assert text(outs) == full[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    streamed = ""
    for o in outs:
        streamed += o.new_text
        assert full[:cut].startswith(streamed), "streamed text went past the stop string's start"


@BOTH_MODES
def test_earliest_stop_string_wins(async_scheduling: bool):
    prompt = prompt_of(5, 4)
    full = greedy_text(prompt)
    early, late = full[8:10], full[20:23]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(late, early))
    outs = run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, params)})["r"]
    assert text(outs) == full[:full.find(early)] and outs[-1].stop_reason == early


@BOTH_MODES
def test_stop_token_ids_and_eos(async_scheduling: bool):
    prompt = prompt_of(4, 3)
    ref = reference_greedy(prompt, 12, ignore_eos=True)
    stop_id = ref[4]
    first = ref.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_id,), ignore_eos=True)
    outs = run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, params)})["r"]
    assert tokens(outs) == ref[:first + 1]  # the stop token counts as generated, its text is not shown
    assert text(outs) == TOK.decode(ref[:first]) and outs[-1].stop_reason == stop_id
    # A model that likes EOS: stop there (EOS not in the text), or go on to max_tokens with ignore_eos.
    ref_eos = reference_greedy(prompt, 12, eos_bias=8.0)
    assert ref_eos[-1] == EOS and len(ref_eos) < 12
    engine = make_engine(eos_bias=8.0, async_scheduling=async_scheduling)
    outs = run(engine, {"eos": (prompt, SamplingParams(max_tokens=12, temperature=0)),
                        "ignore": (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))})
    assert tokens(outs["eos"]) == ref_eos and outs["eos"][-1].finish_reason == "stop"
    assert outs["eos"][-1].stop_reason is None and text(outs["eos"]) == TOK.decode(ref_eos[:-1])
    assert len(tokens(outs["ignore"])) == 12 and outs["ignore"][-1].finish_reason == "length"


def test_incremental_detokenizer_holds_back_split_characters():
    detok = IncrementalDetokenizer(TOK, [1, 2])
    first, second = [t for t in range(VOCAB) if TOK.decode([t]) == "\ufffd"][:2]  # b"\xc3", b"\xa9"
    assert detok.add(TOK.encode("a")[0]) == "a"
    assert detok.add(first) == ""
    assert detok.add(second) == "é"
    text_state = OutputText(TOK, [1])
    text_state.add(first)
    assert text_state.take(finished=False) == ""
    assert text_state.take(finished=True) == "\ufffd"  # what is left at the end is shown as it is


# ---------------------------------------------------------------------------- sampling
@BOTH_MODES
def test_seeded_sampling_is_reproducible_whatever_the_batch(async_scheduling: bool):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = prompt_of(7, 5)
    alone = tokens(run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, params)})["r"])
    crowd = {f"o{i}": (prompt_of(3 + i, i), SamplingParams(max_tokens=15, temperature=0.8, ignore_eos=True))
             for i in range(4)}
    crowd["r"] = (prompt, params)
    batched = tokens(run(make_engine(async_scheduling=async_scheduling), crowd)["r"])
    assert alone == batched
    reseeded = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    other = tokens(run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, reseeded)})["r"])
    assert other != alone


@BOTH_MODES
def test_top_k_1_and_tiny_top_p_are_greedy(async_scheduling: bool):
    prompt = prompt_of(5, 6)
    ref = reference_greedy(prompt, 10, ignore_eos=True)
    for params in (SamplingParams(max_tokens=10, temperature=0.7, top_k=1, ignore_eos=True, seed=1),
                   SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True)):
        assert tokens(run(make_engine(async_scheduling=async_scheduling), {"r": (prompt, params)})["r"]) == ref


def test_sampler_respects_top_k_and_top_p_sets():
    torch.manual_seed(0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(200, 1)
    top2 = Sampler("cpu").sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 200, [None] * 200).tolist()
    assert set(top2) == {0, 1}
    # softmax = [.66, .24, .09, ...]: top_p 0.8 keeps the first two
    top_p = Sampler("cpu").sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 200, [None] * 200).tolist()
    assert set(top_p) == {0, 1}


# ---------------------------------------------------------------------------- cancellation
@BOTH_MODES
def test_abort_frees_blocks_and_leaves_the_others_alone(async_scheduling: bool):
    engine = make_engine(max_num_seqs=2, async_scheduling=async_scheduling)
    keep, drop, queued = prompt_of(9, 1), prompt_of(12, 2), prompt_of(4, 3)
    engine.add_request("keep", keep, GREEDY)
    engine.add_request("drop", drop, GREEDY)
    engine.add_request("queued", queued, GREEDY)  # waits: max_num_seqs=2
    outs: list[RequestOutput] = []
    for _ in range(4):
        outs += engine.step()
    free_before = engine.block_manager.num_free_blocks
    dropped = engine.requests["drop"]
    held = len(dropped.block_table)
    assert held > 0
    final = engine.abort("drop")
    assert final is not None and final.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == free_before + held
    assert engine.abort("drop") is None
    check_blocks(engine)
    for _ in range(200):
        if not engine.has_work():
            break
        outs += engine.step()
    got = [t for o in outs if o.request_id == "keep" for t in o.new_token_ids]
    assert got == reference_greedy(keep, 12, ignore_eos=True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # A waiting request can be aborted too.
    engine.add_request("w", prompt_of(3), GREEDY)
    assert engine.abort("w").finish_reason == "abort" and not engine.has_work()


# ---------------------------------------------------------------------------- async scheduling
def test_async_scheduling_hands_out_a_steps_tokens_with_the_next_step():
    engine = make_engine(async_scheduling=True)
    engine.add_request("r", prompt_of(3), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    want = reference_greedy(prompt_of(3), 3, ignore_eos=True)
    assert engine.step() == [] and engine.has_work()  # the prefill's token is still on the device
    seq = engine.requests["r"]
    assert (seq.num_pending, seq.output_token_ids, seq.num_tokens) == (1, [], 4)
    assert [o.new_token_ids for o in engine.step()] == [want[:1]]  # launched the next step, then read it
    assert [o.new_token_ids for o in engine.step()] == [want[1:2]]
    # Its last token is pending and reaches max_tokens: nothing more is computed, the step only reads it.
    forwards = engine.model.num_forwards
    last = engine.step()
    assert [o.new_token_ids for o in last] == [want[2:]] and last[0].finish_reason == "length"
    assert engine.model.num_forwards == forwards and not engine.has_work()
    assert engine.flush() == []


@pytest.mark.parametrize("eos_bias", [-4.0, 8.0], ids=["length", "eos"])
def test_async_scheduling_computes_at_most_a_row_more_per_sequence_stopping_on_a_token(eos_bias: float):
    """max_tokens and max_model_len are known ahead: no wasted row. EOS is known a step late: at most one
    row (none where the tokens were flushed before a prompt step)."""
    requests = {f"r{i}": (prompt_of(3 + 4 * i, i), SamplingParams(max_tokens=6 + 3 * i, temperature=0))
                for i in range(4)}
    requests["long"] = (prompt_of(5, 9), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    runs = {}
    for mode in (False, True):
        engine = make_engine(eos_bias=eos_bias, max_model_len=40, async_scheduling=mode)
        outs = run(engine, requests)
        runs[mode] = ({rid: (tokens(o), o[-1].finish_reason) for rid, o in outs.items()},
                      sum(n for _, n in engine.model.batches))
        check_blocks(engine)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    (sync_outs, sync_rows), (async_outs, async_rows) = runs[False], runs[True]
    assert async_outs == sync_outs
    want_long = reference_greedy(prompt_of(5, 9), 35, eos_bias=eos_bias, ignore_eos=True)
    assert sync_outs["long"] == (want_long, "length")  # cut at max_model_len
    stopped_on_eos = sum(reason == "stop" for _, reason in sync_outs.values())
    assert (stopped_on_eos > 0) == (eos_bias > 0)
    assert sync_rows <= async_rows <= sync_rows + stopped_on_eos


def test_pending_outputs_go_out_before_an_eager_step_where_graphs_are_captured(monkeypatch: pytest.MonkeyPatch):
    """With step graphs of up to 4 tokens: a pending token stays pending before a prompt step that a graph holds,
    and goes out before one that may take more (it runs eagerly: in normal mode it waits for its dispatch)."""
    engine = make_engine(async_scheduling=True, token_budget=16)
    monkeypatch.setattr(type(engine.runner), "captured_sizes", property(lambda self: [1, 2, 4]))
    engine.add_request("a", prompt_of(3), GREEDY)
    engine.execute(engine.schedule())  # a's prompt: its first token pending
    engine.add_request("b", prompt_of(2, 1), GREEDY)
    assert engine.flush_if_prompt_next() == []  # a's decode and b's prompt: 3 tokens, a graph's step
    assert engine.requests["a"].num_pending == 1
    engine.add_request("c", prompt_of(6, 2), GREEDY)
    assert [(o.request_id, o.num_output_tokens) for o in engine.flush_if_prompt_next()] == [("a", 1)]


def test_the_next_schedule_bounds_its_tokens():
    """Scheduler.may_take_more_than: each running sequence's next tokens (a decode's one, a prompt's chunk up to
    the long-prefill cap), then the waiting prompts that may start, against the budget."""
    engine = make_engine(token_budget=32, max_num_seqs=3, long_prefill_token_threshold=10)
    scheduler = engine.scheduler
    assert not scheduler.may_take_more_than(0)
    for rid, n in (("a", 3), ("b", 25), ("c", 7), ("d", 9)):
        engine.add_request(rid, prompt_of(n), GREEDY)
    # Waiting: a (3), b (25, capped at 10), c (7); d waits for a free place among max_num_seqs = 3.
    assert scheduler.may_take_more_than(19) and not scheduler.may_take_more_than(20)
    engine.execute(engine.schedule(), moe_mode="normal")  # a whole, b's first 10, c whole
    # Next: a's and c's decodes and b's next 10; d still waits (three run).
    assert scheduler.may_take_more_than(11) and not scheduler.may_take_more_than(12)
    assert not scheduler.may_take_more_than(32)  # the budget bounds every step


def test_pending_outputs_go_out_before_a_prompt_step():
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", prompt_of(3), GREEDY)
    got = {"a": engine.step() + engine.step(), "b": []}  # a's prompt, then a decode: one token out, one pending
    assert engine.flush_if_prompt_next() == []  # no prompt to take: a's token stays pending
    assert engine.requests["a"].num_pending == 1
    engine.add_request("b", prompt_of(5, 1), GREEDY)
    forwards = engine.model.num_forwards
    outs = engine.step()  # b's prompt comes next: this step only hands out a's pending token
    assert [(o.request_id, o.num_output_tokens) for o in outs] == [("a", 2)]
    assert engine.model.num_forwards == forwards and engine.requests["a"].num_pending == 0
    got["a"] += outs
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].append(out)
    assert tokens(got["a"]) == reference_greedy(prompt_of(3), 12, ignore_eos=True)
    assert tokens(got["b"]) == reference_greedy(prompt_of(5, 1), 12, ignore_eos=True)


def test_async_scheduling_survives_preemption_and_aborts_with_pending_tokens():
    engine = make_engine(budget=8, block_size=4, num_blocks=12, max_model_len=48, async_scheduling=True)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_of(20, i), params)
    outs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(3)}
    aborted = None
    for _ in range(500):
        if not engine.has_work():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
        if aborted is None and engine.scheduler.num_preemptions and engine.requests["r0"].num_pending:
            aborted = engine.abort("r0")  # its pending token is dropped when it arrives
            check_blocks(engine)
    assert aborted is not None and aborted.finish_reason == "abort"
    assert all(o.finish_reason is None for o in outs["r0"])
    for rid in ("r1", "r2"):
        assert tokens(outs[rid]) == reference_greedy(prompt_of(20, int(rid[1])), 20, ignore_eos=True), rid
    assert engine.block_manager.num_free_blocks == 12


# ---------------------------------------------------------------------------- expert parallelism
def greedy_in_step(engine: LLMEngine, sync: StepSync, rank: int, prompt_lengths: list[int]) -> bool:
    """Greedy requests of these prompt lengths, stepped with the peers (as serving.engine.rank_worker.RankLoop
    steps) until no rank has work: whether each got the reference's tokens."""
    for i, n in enumerate(prompt_lengths):
        engine.add_request(f"r{rank}-{i}", prompt_of(n, 10 * rank + i), GREEDY)
    got: dict[str, list[int]] = {f"r{rank}-{i}": [] for i in range(len(prompt_lengths))}
    for _ in range(500):
        for out in engine.step(sync):
            got[out.request_id] += out.new_token_ids
        if not sync.plan.step and not engine.has_work():
            break
    return got == {f"r{rank}-{i}": reference_greedy(prompt_of(n, 10 * rank + i), 12, ignore_eos=True)
                   for i, n in enumerate(prompt_lengths)}


def _ep_rank(rank: int, world_size: int, async_scheduling: bool) -> dict:
    import torch.distributed as dist

    sync = StepSync(dist.new_group(backend="gloo"))
    engine = make_engine(budget=8, group=dist.group.WORLD, rank=rank, num_ranks=world_size,
                         async_scheduling=async_scheduling)
    ok = greedy_in_step(engine, sync, rank, {0: [3, 20, 7], 1: [2]}[rank])
    engine.add_request("late", prompt_of(4), GREEDY)
    forwards = engine.model.num_forwards
    left = engine.step(sync, leaving=rank == 1)  # rank 1 was told to stop: both leave, neither steps
    return {"ok": ok, "forwards": forwards, "empty": engine.model.num_empty_forwards,
            "left": left == [] and sync.plan.stop and engine.model.num_forwards == forwards}


@BOTH_MODES
def test_expert_parallel_ranks_step_together_with_empty_batches(async_scheduling: bool):
    results = run_ranks(_ep_rank, 2, async_scheduling, timeout_s=60)
    assert all(r["ok"] for r in results), results
    assert results[0]["forwards"] == results[1]["forwards"]  # FakeModel also checks this at every forward
    assert all(r["left"] for r in results), results
    assert results[0]["empty"] == 0 and results[1]["empty"] > 0


def _deepep_mode_rank(rank: int, world_size: int, deepep_mode: str) -> dict:
    import torch.distributed as dist

    sync = StepSync(dist.new_group(backend="gloo"))
    engine = make_engine(budget=8, group=dist.group.WORLD, rank=rank, num_ranks=world_size, token_budget=32,
                         deepep_mode=deepep_mode)
    # Rank 0's first prompt fits one 32-token step, not the T of 8.
    ok = greedy_in_step(engine, sync, rank, {0: [30, 5], 1: [3]}[rank])
    return {"ok": ok, "modes": engine.model.moe_modes, "batches": engine.model.batches}


@pytest.mark.parametrize("deepep_mode", ["auto", "normal"])
def test_deepep_mode_runs_large_steps_in_normal_mode_on_every_rank(deepep_mode: str):
    """With a step budget above the low-latency T, a step in which any rank holds more than T tokens runs
    in normal mode on every rank (auto), or every step does (normal); FakeModel checks at each forward
    that the ranks agree and that a low-latency step holds at most T tokens."""
    results = run_ranks(_deepep_mode_rank, 2, deepep_mode, timeout_s=60)
    assert all(r["ok"] for r in results), results
    first = results[0]
    assert first["batches"][0][1] == 32  # the whole budget: 30 + 2 prompt tokens, four times T
    if deepep_mode == "normal":
        assert set(first["modes"]) == {"normal"}
    else:
        steps = list(zip(*(zip(r["batches"], r["modes"]) for r in results)))
        for step in steps:  # normal exactly where some rank holds more than T
            assert {m for _, m in step} == {"normal" if max(n for (_, n), _ in step) > 8 else "low_latency"}, step
        assert {"normal", "low_latency"} <= set(first["modes"])


def test_low_latency_mode_never_steps_past_t():
    engine = make_engine(budget=8)
    run(engine, {"a": (prompt_of(30), GREEDY)})
    assert set(engine.model.moe_modes) == {"low_latency"} and engine.model.max_batch_tokens == 8


def _agree_rank(rank: int, world_size: int) -> list[tuple]:
    import torch.distributed as dist

    sync = StepSync(dist.new_group(backend="gloo"))
    cases = [  # (this rank's tokens, stop) per rank, one step each
        {0: (3, False), 1: (0, False)},  # an idle rank replays the busy rank's step graph on padding
        {0: (2, False), 1: (37, False)},  # the larger rank's tokens pick the graph
        {0: (0, False), 1: (0, False)},  # nothing to do
        {0: (4, False), 1: (1, True)},  # one rank stops: all leave
    ]
    plans = []
    for case in cases:
        plan = sync.agree(*case[rank])
        plans.append((plan.step, plan.max_num_tokens, plan.stop))
    return plans


def test_step_sync_agrees_on_step_tokens_and_stop():
    results = run_ranks(_agree_rank, 2, timeout_s=60)
    assert results[0] == results[1] == [(True, 3, False), (True, 37, False), (False, 0, False), (False, 4, True)]
    alone = StepSync().agree(2)
    assert (alone.step, alone.max_num_tokens, alone.stop) == (True, 2, False)
