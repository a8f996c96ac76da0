"""vLLM's sampling features in serving.engine (sampling.py, sequence.SamplingParams, the engine's logprobs
and penalties), against float64 oracles: penalties, min_p / top-k / top-p distributions and logprobs on
random logits; seeded determinism; and the engine end to end on the fake model (tests/serving_fakes.py)
and on the built-in tiny DeepSeek-V3 (CPU), whose logprobs and prompt logprobs are checked against a
whole-sequence forward of a fresh copy of the model.

The semantics follow vLLM (github.com/vllm-project/vllm):
- vllm/sampling_params.py @ db573835d3ef40643442e0817059e087355cf458: the fields, defaults and meanings
  (presence/frequency penalties in [-2, 2] over generated tokens, repetition_penalty over prompt and
  generated tokens, min_p in [0, 1], logprobs / prompt_logprobs counts besides the token's own);
  repetition_penalty's range is the later releases' (> 0 and finite; that commit still capped it at 2).
- vllm/v1/sample/sampler.py @ 3e342658b2e9c85a30a54d19e64e5ad77b8a26a6: the order (penalties, then greedy
  argmax, else temperature, min_p, top-k/top-p); logprobs_mode "raw_logprobs" by default (log_softmax of
  the logits before any processing); gather_logprobs (the token's own logprob first, then torch.topk).
- vllm/model_executor/layers/utils.py @ 00358600ed52e00c3c99b35e54aa916f900c4c15 (apply_penalties):
  repetition (positive logits divided, negative multiplied), then frequency times the output count,
  then presence once per output token.
- vllm/v1/sample/logits_processor/builtin.py @ bf17660a2493b9cec475b6ba790a390afd317e8b (MinP): after
  temperature, tokens with probability < min_p * the largest are dropped.
- vllm/v1/engine/parallel_sampling.py @ 491d923514ad9c40e665dc8deae57dd377cb88b0: with n > 1 and a seed,
  choice i samples with seed + i (what serving/api/server.py already passes the engine).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from serving_fakes import FakeModel, FakeTokenizer, reference_greedy, reference_next
from serving_model_helpers import PagedRunner
from test_serving_engine import prompt_of, run, tokens

from serving.engine.engine import LLMEngine
from serving.engine.messages import RequestOutput, TokenLogprobs
from serving.engine.model_runner import logits_rows
from serving.engine.sampling import (
    Sampler,
    TokenCounts,
    apply_penalties,
    make_generator,
    sampling_probs,
    token_logprobs,
)
from serving.engine.scheduler import ScheduledBatch
from serving.engine.sequence import MAX_LOGPROBS, BadRequest, RepetitionDetection, SamplingParams
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.tiny_model import write_tiny_checkpoint

BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
LOGPROB_ATOL = 1e-5  # float32 log_softmax against float64, for logits of magnitude ~10


# ---------------------------------------------------------------------------- float64 oracles
def penalized_oracle(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on one row, token by token in float64."""
    counts = Counter(output)
    out = row.double().clone()
    for t in range(out.shape[0]):
        x = float(out[t])
        if t in prompt or counts[t]:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out[t] = x - p.frequency_penalty * counts[t] - p.presence_penalty * (counts[t] > 0)
    return out


def probs_oracle(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution of a sampled row in float64: temperature, min_p, top-k, top-p."""
    x = row.double() / p.temperature
    probs = x.softmax(-1)
    x[probs < p.min_p * probs.max()] = -math.inf
    order = sorted(range(x.shape[0]), key=lambda t: -float(x[t]))
    if 0 < p.top_k < x.shape[0]:
        for t in order[p.top_k:]:
            x[t] = -math.inf
    if p.top_p < 1.0:
        probs, above = x.softmax(-1), 0.0
        for i, t in enumerate(order):
            if i > 0 and above >= p.top_p:
                x[t] = -math.inf
            above += float(probs[t])
    return x.softmax(-1)


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


# ---------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(("field", "bad", "good"), [
    ("presence_penalty", [-2.01, 2.5, math.nan], [-2.0, 0.0, 2.0]),
    ("frequency_penalty", [-3.0, 2.01, math.nan], [-2.0, 1.5, 2.0]),
    ("repetition_penalty", [0.0, -1.0, math.inf, math.nan], [0.01, 1.0, 2.0, 5.0]),
    ("min_p", [-0.1, 1.01, math.nan], [0.0, 0.5, 1.0]),
    ("logprobs", [-1, MAX_LOGPROBS + 1], [None, 0, 5, MAX_LOGPROBS]),
    ("prompt_logprobs", [-1, MAX_LOGPROBS + 1], [None, 0, 1, MAX_LOGPROBS]),
])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(field: str, bad: list, good: list):
    for value in bad:
        with pytest.raises(BadRequest, match=field) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field
    for value in good:
        SamplingParams(**{field: value})


def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.0, 0.0)
    assert (p.logprobs, p.prompt_logprobs, p.seed) == (None, None, None)
    assert not p.penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(presence_penalty=-0.5).penalized


# ---------------------------------------------------------------------------- the sampler
def test_penalties_match_the_oracle_and_counts_advance_on_the_device(seed: int):
    vocab = 12
    logits = random_logits(5, vocab, seed)
    logits[0, :4] = torch.tensor([0.0, 1.5, -1.5, 3.0])  # zero, positive and negative logits penalised
    histories = {  # batch row -> (prompt, output, params); row 1 has no penalties
        0: ([0, 1, 2], [3, 3, 5], SamplingParams(repetition_penalty=1.7, temperature=0)),
        2: ([4, 4, 7], [7, 8, 8, 8, 1], SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4)),
        3: ([1], [], SamplingParams(repetition_penalty=0.5, frequency_penalty=2.0, presence_penalty=2.0)),
        4: ([9, 10], [2, 2, 11], SamplingParams(repetition_penalty=1.3, frequency_penalty=-2.0,
                                                presence_penalty=0.7, temperature=0.8)),
    }
    params = [histories[i][2] if i in histories else SamplingParams() for i in range(5)]
    counts = TokenCounts(vocab, "cpu")
    counts.assign([5], [1, 2])  # a row of another sequence, released: its row is reset when reused
    counts.release(0)
    slots = [counts.assign(prompt, output) for prompt, output, _ in histories.values()]
    history = counts.history(list(histories), slots)
    got = apply_penalties(logits, history, params)
    assert torch.equal(got[1], logits[1]), f"seed={seed}: a row without penalties changed"
    for i, (prompt, output, p) in histories.items():
        want = penalized_oracle(logits[i], prompt, output, p)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert float(got[0, 0]) == 0.0 and float(got[0, 1]) == pytest.approx(1.5 / 1.7)
    assert float(got[0, 2]) == pytest.approx(-1.5 * 1.7)
    tokens = torch.tensor([3, 0, 8, 1, 6])
    counts.record(history, tokens)
    for (prompt, output, _), slot, token in zip(histories.values(), slots, tokens[list(histories)].tolist()):
        want = Counter([*output, token])
        assert counts.output[slot].tolist() == [want[t] for t in range(vocab)]
        assert counts.prompt[slot].tolist() == [t in prompt for t in range(vocab)]
    assert counts.num_assigned == 4


def test_token_counts_grow_and_reuse_rows():
    counts = TokenCounts(5, "cpu")
    rows = [counts.assign([i % 5]) for i in range(20)]
    assert sorted(rows) == list(range(20)) and counts.output.shape[0] >= 20
    counts.record(counts.history([0], [rows[3]]), torch.tensor([4]))
    assert counts.output[rows[3]].tolist() == [0, 0, 0, 0, 1]
    counts.release(rows[3])
    again = counts.assign([0], [2, 2])
    assert again == rows[3] and counts.output[again].tolist() == [0, 0, 2, 0, 0]
    assert counts.prompt[again].tolist() == [True, False, False, False, False]


@pytest.mark.parametrize("params", [
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=0.6),
    SamplingParams(min_p=0.05, top_k=4, temperature=1.4),
    SamplingParams(min_p=0.02, top_p=0.7),
    SamplingParams(top_k=6, top_p=0.9, temperature=0.9),
    SamplingParams(min_p=1.0),
], ids=["min_p", "min_p-temp", "min_p-top_k", "min_p-top_p", "top_k-top_p", "min_p-1"])
def test_sampling_distribution_matches_the_oracle(params: SamplingParams, seed: int):
    logits = random_logits(6, 40, seed)
    got = sampling_probs(logits, [params] * 6)
    for i in range(6):
        want = probs_oracle(logits[i], params)
        assert torch.equal(got[i] > 0, want > 0), f"seed={seed}: row {i} keeps other tokens"
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")
    # Every draw lies in the kept set.
    draws = torch.multinomial(got, 200, replacement=True, generator=torch.Generator().manual_seed(seed))
    assert bool((got.gather(1, draws) > 0).all())


def test_logprobs_are_log_softmax_of_the_raw_logits_whatever_the_processing(seed: int):
    vocab = 50
    logits = random_logits(6, vocab, seed)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.7, logprobs=0, seed=1),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, min_p=0.05, top_k=10, logprobs=5, frequency_penalty=1.0, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0, logprobs=MAX_LOGPROBS)]
    counts = TokenCounts(vocab, "cpu")
    slots = [counts.assign([1, 2, 3], [4, 4]), counts.assign([5], [6])]
    history = counts.history([0, 3], slots)
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    out = Sampler("cpu", seed=seed).run(logits, params, generators, history)
    assert out.logprob_rows == [0, 1, -1, 2, -1, 3]
    assert out.logprob_ids is not None and out.logprob_values is not None
    assert out.logprob_ids.shape == out.logprob_values.shape == (4, 1 + MAX_LOGPROBS)
    want_all = logits.double().log_softmax(-1)
    for i, row in enumerate(out.logprob_rows):
        if row < 0:
            continue
        token, want = int(out.tokens[i]), want_all[i]
        assert int(out.logprob_ids[row, 0]) == token
        assert float(out.logprob_values[row, 0]) == pytest.approx(float(want[token]), abs=LOGPROB_ATOL)
        top = torch.topk(logits[i], MAX_LOGPROBS)
        assert out.logprob_ids[row, 1:].tolist() == top.indices.tolist(), f"seed={seed}: row {i}"
        torch.testing.assert_close(out.logprob_values[row, 1:].double(), want[top.indices], rtol=0,
                                   atol=LOGPROB_ATOL)
    # Greedy rows take the argmax of the penalised logits, not of the raw ones.
    processed = apply_penalties(logits, history, params)
    assert int(out.tokens[0]) == int(processed[0].argmax()) and int(out.tokens[2]) == int(logits[2].argmax())
    assert int(out.tokens[5]) == int(logits[5].argmax())


def shaped_oracle(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's allowed_token_ids mask, then logit_bias, on one row, token by token in float64."""
    out = row.double().clone()
    for t in range(out.shape[0]):
        if p.allowed_token_ids is not None and t not in p.allowed_token_ids:
            out[t] = -math.inf
    for t, bias in p.logit_bias:
        out[t] += bias
    return out


def test_allowed_token_ids_and_logit_bias_shape_what_is_drawn_but_not_the_logprobs(seed: int):
    vocab, rng = 40, torch.Generator().manual_seed(seed)
    logits = random_logits(8, vocab, seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randperm(vocab, generator=rng)[:n].tolist())

    def biases(n: int) -> tuple[tuple[int, float], ...]:
        return tuple((t, float(torch.empty(()).uniform_(-100, 100, generator=rng))) for t in ids(n))

    params = [SamplingParams(temperature=0, allowed_token_ids=ids(5), logprobs=2),
              SamplingParams(temperature=0, logit_bias=biases(6)),
              SamplingParams(temperature=0, allowed_token_ids=ids(7), logit_bias=biases(20), logprobs=0),
              SamplingParams(temperature=0, allowed_token_ids=ids(1)),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, allowed_token_ids=ids(3), seed=3),
              SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias=((0, 8.0), (1, -3.0))),
              SamplingParams(temperature=0.5, top_k=2, allowed_token_ids=ids(9), logit_bias=biases(4), seed=4)]
    counts = TokenCounts(vocab, "cpu")
    history = counts.history([6], [counts.assign([0, 2], [1])])
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    out = Sampler("cpu", seed=seed).run(logits, params, generators, history)
    for i, p in enumerate(params):
        token = int(out.tokens[i])
        shaped = shaped_oracle(logits[i], p)
        if i == 6:  # the penalties come after the bias
            shaped = penalized_oracle(shaped.float(), [0, 2], [1], p)
        if p.greedy:
            assert token == int(shaped.argmax()), (seed, i)
        assert math.isfinite(float(shaped[token])), (seed, i)  # never a masked token
    raw = logits.double().log_softmax(-1)
    for i, row in enumerate(out.logprob_rows):  # vLLM's raw logprobs: before the mask and the bias
        if row >= 0:
            assert float(out.logprob_values[row, 0]) == pytest.approx(float(raw[i, int(out.tokens[i])]),
                                                                      abs=LOGPROB_ATOL)


def test_out_of_vocabulary_ids_and_empty_allowed_lists_are_refused_naming_the_field():
    with pytest.raises(BadRequest, match="allowed_token_ids: expected at least one token id") as e:
        SamplingParams(allowed_token_ids=())
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(BadRequest, match="logit_bias: expected finite biases"):
        SamplingParams(logit_bias=((1, math.nan),))
    for field, params in (("stop_token_ids", SamplingParams(stop_token_ids=(64,))),
                          ("allowed_token_ids", SamplingParams(allowed_token_ids=(3, 64))),
                          ("logit_bias", SamplingParams(logit_bias=((64, 1.0),)))):
        with pytest.raises(BadRequest, match=f"{field}: token id 64 is outside the vocabulary") as e:
            params.check_vocabulary(64)
        assert e.value.param == field
        with pytest.raises(BadRequest, match=field):
            fake_engine(False).add_request("r", [1, 2], params)
        params.check_vocabulary(65)


def test_repetition_detection_finds_a_tail_of_repeated_patterns(seed: int):
    """RepetitionDetection.found against a brute-force oracle: some size in [min (0: 1), max] whose last min_count
    slices of that size are equal; on random short sequences over three tokens (many repeat)."""
    rng = random.Random(seed)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
        low, high, count = rng.randrange(0, 3), rng.randrange(0, 5), rng.randrange(2, 5)
        if low > high:
            low, high = high, low
        detect = RepetitionDetection(high, low, count)
        n = len(tokens)
        want = high > 0 and any(size * count <= n and len({tuple(tokens[n - size * (m + 1):n - size * m])
                                                            for m in range(count)}) == 1
                                for size in range(max(low, 1), high + 1))
        assert detect.found(tokens) == want, (tokens, low, high, count)
    for bad in ((2, 3, 2), (-1, 0, 2), (3, 0, 1)):
        with pytest.raises(BadRequest, match="repetition_detection"):
            RepetitionDetection(*bad)


def test_token_logprobs_with_no_top():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    ids, values, ranks = token_logprobs(logits, torch.tensor([0]), 0)
    assert ids.tolist() == [[0]] and ranks.tolist() == [3]
    assert float(values[0, 0]) == pytest.approx(1.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)))


def test_greedy_with_penalties_avoids_what_was_said():
    logits = torch.tensor([[4.0, 3.9, -1.0, 0.5]])
    cases = [  # (prompt, output, params, the greedy token)
        ([2], [], SamplingParams(temperature=0), 0),
        ([0], [], SamplingParams(temperature=0, repetition_penalty=1.1), 1),  # 4 / 1.1 < 3.9
        ([], [0, 0, 0], SamplingParams(temperature=0, frequency_penalty=1.5), 1),  # 4 - 4.5 < 3.9
        ([], [0], SamplingParams(temperature=0, presence_penalty=0.2), 1),  # 4 - 0.2 < 3.9
        ([], [0, 0, 1, 1], SamplingParams(temperature=0, frequency_penalty=2.0), 3),  # 4 - 4, 3.9 - 4 < 0.5
    ]
    counts = TokenCounts(4, "cpu")
    for prompt, output, p, want in cases:
        history = counts.history([0], [counts.assign(prompt, output)])
        assert int(Sampler("cpu").run(logits, [p], [None], history).tokens[0]) == want, (prompt, output, p)


def test_seeded_sampling_with_penalties_and_min_p_is_reproducible_whatever_the_batch(seed: int):
    vocab = 30
    logits = random_logits(4, vocab, seed) / 4  # flat enough that draws of different seeds differ
    mine = SamplingParams(temperature=1.2, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.2, seed=77,
                          logprobs=2)

    def draw(rows: list[int], mine_at: int, params_seed: int) -> list[int]:
        counts = TokenCounts(vocab, "cpu")
        params = [SamplingParams(temperature=0.9)] * len(rows)
        params[mine_at] = mine
        gens: list[torch.Generator | None] = [None] * len(rows)
        gens[mine_at] = make_generator(params_seed, "cpu")
        history = counts.history([mine_at], [counts.assign([1, 2], [3])])
        sampler = Sampler("cpu", seed=seed)
        return [int(sampler.run(logits[rows], params, gens, history).tokens[mine_at]) for _ in range(20)]

    alone = draw([2], 0, 77)
    assert draw([0, 1, 2, 3], 2, 77) == alone, f"seed={seed}"
    assert draw([3, 2], 1, 77) == alone, f"seed={seed}"
    assert draw([2], 0, 78) != alone, f"seed={seed}"


# ---------------------------------------------------------------------------- the engine, fake model
TOK = FakeTokenizer()


def fake_engine(async_scheduling: bool, num_blocks: int = 256, max_model_len: int = 128) -> LLMEngine:
    return LLMEngine(FakeModel(8), TOK, num_blocks=num_blocks, block_size=4, max_model_len=max_model_len,
                     max_num_seqs=8, max_tokens_per_rank=8, device=torch.device("cpu"),
                     async_scheduling=async_scheduling)


def logprobs(outs: list[RequestOutput]) -> list[TokenLogprobs]:
    return [lp for o in outs for lp in (o.logprobs or [])]


def penalized_greedy(prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """The fake model's greedy continuation under p's penalties, in float64."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(penalized_oracle(reference_next(prompt + out), prompt, out, p).argmax()))
    return out


def check_logprobs(entry: TokenLogprobs, logits: torch.Tensor, token: int, k: int, atol: float = LOGPROB_ATOL) -> None:
    """entry against log_softmax of `logits` in float64: the token's own, and the top k's values (ids
    up to ties: each listed id has the listed logprob)."""
    want = logits.double().log_softmax(-1)
    assert entry.logprob == pytest.approx(float(want[token]), abs=atol)
    assert entry.rank == 1 + int((want > want[token]).sum())
    assert len(entry.top) == k
    assert [v for _, v in entry.top] == pytest.approx(want.topk(k).values.tolist(), abs=atol)
    for t, v in entry.top:
        assert v == pytest.approx(float(want[t]), abs=atol)


@BOTH_MODES
def test_engine_logprobs_of_generated_tokens_are_the_models(async_scheduling: bool):
    requests = {"greedy": (prompt_of(5, 1), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                           logprobs=4)),
                "sampled": (prompt_of(9, 2), SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True,
                                                            logprobs=0, min_p=0.05)),
                "penalized": (prompt_of(3, 3), SamplingParams(max_tokens=8, temperature=0.8, seed=6, ignore_eos=True,
                                                              logprobs=MAX_LOGPROBS, repetition_penalty=1.3)),
                "plain": (prompt_of(4, 4), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))}
    outs = run(fake_engine(async_scheduling), requests)
    assert tokens(outs["greedy"]) == reference_greedy(prompt_of(5, 1), 10, ignore_eos=True)
    assert tokens(outs["plain"]) == reference_greedy(prompt_of(4, 4), 6, ignore_eos=True)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs["plain"])
    for rid, (prompt, p) in requests.items():
        if p.logprobs is None:
            continue
        got = tokens(outs[rid])
        assert len(logprobs(outs[rid])) == len(got) == p.max_tokens
        assert all(len(o.logprobs or []) == len(o.new_token_ids) for o in outs[rid])
        for j, entry in enumerate(logprobs(outs[rid])):
            check_logprobs(entry, reference_next(prompt + got[:j]), got[j], p.logprobs)


@BOTH_MODES
@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy", "preempting"])
def test_engine_penalties_change_greedy_output_as_the_oracle_predicts(async_scheduling: bool, num_blocks: int):
    penalties = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.8),
                 SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                                presence_penalty=0.5),
                 SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=0.6,
                                presence_penalty=-1.0)]
    requests = {f"p{i}": (prompt_of(14, i), p) for i, p in enumerate(penalties)}
    requests["plain"] = (prompt_of(14, 7), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    engine = fake_engine(async_scheduling, num_blocks=num_blocks, max_model_len=32)
    outs = run(engine, requests)
    if num_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(penalties):
        prompt = prompt_of(14, i)
        want = penalized_greedy(prompt, 14, p)
        assert want != reference_greedy(prompt, 14, ignore_eos=True), f"p{i}: pick a penalty that matters"
        assert tokens(outs[f"p{i}"]) == want, f"p{i}"
    assert tokens(outs["plain"]) == reference_greedy(prompt_of(14, 7), 14, ignore_eos=True)
    assert engine.token_counts.num_assigned == 0  # every finished sequence gave its row back


@BOTH_MODES
def test_aborting_a_penalized_request_frees_its_counts(async_scheduling: bool):
    engine = fake_engine(async_scheduling)
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, frequency_penalty=1.0)
    engine.add_request("a", prompt_of(4), p)
    engine.add_request("b", prompt_of(6, 1), p)
    for _ in range(4):
        engine.step()
    assert engine.token_counts.num_assigned == 2
    engine.abort("a")
    assert engine.token_counts.num_assigned == 1
    outs: list[RequestOutput] = []
    while engine.has_work():
        outs += engine.step()
    assert engine.token_counts.num_assigned == 0
    engine.add_request("c", prompt_of(5, 2), p)  # takes a row given back: counted afresh
    while engine.has_work():
        outs += engine.step()
    assert tokens([o for o in outs if o.request_id == "c"]) == penalized_greedy(prompt_of(5, 2), 50, p)
    assert engine.token_counts.num_assigned == 0


# ---------------------------------------------------------------------------- the engine, tiny DeepSeek-V3
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


def tiny_engine(path: str, async_scheduling: bool, budget: int = 8) -> LLMEngine:
    model = load_checkpoint(path, backend="reference", max_tokens_per_rank=budget, dtype=torch.float32, device="cpu",
                       progress=False)
    return LLMEngine(model, read_tokenizer(path), num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                     max_tokens_per_rank=budget, device=torch.device("cpu"), async_scheduling=async_scheduling)


def whole_sequence_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of `token_ids`, from one prefill of a fresh model."""
    model = load_checkpoint(path, backend="reference", max_tokens_per_rank=64, dtype=torch.float32, device="cpu",
                       progress=False)
    with torch.inference_mode():
        rows = PagedRunner(model, {0: token_ids}).run([[(0, len(token_ids))]], all_logits=True)
    return torch.stack([rows[(0, p)] for p in range(len(token_ids))])


def tiny_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@BOTH_MODES
@pytest.mark.parametrize("budget", [64, 8], ids=["one-step-prefill", "chunked-prefill"])
def test_tiny_model_logprobs_and_prompt_logprobs_match_a_whole_sequence_forward(checkpoint: str, budget: int,
                                                                                 async_scheduling: bool):
    """Prompts in one prefill step, or longer than the step budget (chunks of <= 8), beside a request
    without logprobs, whose tokens must not change. The MoE layers run in bf16, so a token's hidden
    state rounds differently when its prompt was split in chunks: logprobs then agree to ~3e-3 only
    (a logprob of the wrong position or token is off by ~2, the spread of these logprobs)."""
    engine = tiny_engine(checkpoint, async_scheduling, budget)
    # A prompt prefilled in one step computes as the whole-sequence forward does (1e-4); chunks, and the
    # generated tokens' decode steps, attend by another path, whose float32 differences flip some of the MoE
    # layers' bf16 roundings (2**-9 relative): logprobs then move by a few 1e-3.
    atol = 1e-4 if budget == 64 else 1e-2
    decode_atol = 1e-2
    asks = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompt_only = SamplingParams(max_tokens=3, temperature=0.9, seed=3, ignore_eos=True, prompt_logprobs=0)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = {"asks": (tiny_prompt(19, 1), asks), "prompt_only": (tiny_prompt(11, 2), prompt_only),
                "plain": (tiny_prompt(19, 1), plain), "one": (tiny_prompt(1, 3), asks)}
    outs = run(engine, requests)
    assert tokens(outs["plain"]) == tokens(outs["asks"])  # the same prompt: logprobs change nothing
    for rid, (prompt, p) in requests.items():
        got = tokens(outs[rid])
        logits = whole_sequence_logits(checkpoint, prompt + got[:-1])
        firsts = [o.prompt_logprobs for o in outs[rid]]
        if p.prompt_logprobs is None:
            assert firsts == [None] * len(firsts)
        else:  # on the first token's output only
            assert outs[rid][0].new_token_ids and all(f is None for f in firsts[1:])
            prompt_lps = firsts[0]
            assert prompt_lps is not None and len(prompt_lps) == len(prompt) and prompt_lps[0] is None
            for t in range(1, len(prompt)):
                check_logprobs(prompt_lps[t], logits[t - 1], prompt[t], p.prompt_logprobs, atol)
        if p.logprobs is None:
            assert logprobs(outs[rid]) == []
        else:
            assert len(logprobs(outs[rid])) == len(got)
            for j, entry in enumerate(logprobs(outs[rid])):
                check_logprobs(entry, logits[len(prompt) - 1 + j], got[j], p.logprobs, atol if j == 0 else decode_atol)
        if p.greedy:
            assert got == logits[len(prompt) - 1:].argmax(-1).tolist(), rid


def test_tiny_model_prompt_logprobs_survive_preemption_mid_prompt(checkpoint: str):
    """A sequence preempted after its first chunk recomputes its prompt but not its prompt logprobs:
    the same outputs as a run without preemption."""
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3, logprobs=1,
                       repetition_penalty=1.4)
    prompt = tiny_prompt(21, 4)
    want = run(tiny_engine(checkpoint, False), {"r": (prompt, p)})["r"]
    engine = tiny_engine(checkpoint, False)
    engine.add_request("r", prompt, p)
    assert engine.step() == []  # the first chunk of 8
    seq = engine.requests["r"]
    assert (seq.num_computed_tokens, seq.num_prompt_logprobs, len(seq.prompt_logprob_parts)) == (8, 8, 1)
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq)
    got: list[RequestOutput] = []
    while engine.has_work():
        got += engine.step()
    assert engine.scheduler.num_preemptions == 1 and seq.num_prompt_logprobs == 20
    assert tokens(got) == tokens(want)
    got_prompt, want_prompt = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert got_prompt is not None and want_prompt is not None and len(got_prompt) == len(want_prompt) == 21
    for a, b in zip(got_prompt[1:], want_prompt[1:]):
        assert a is not None and b is not None
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_logits_rows_are_one_per_sequence_except_prompt_logprob_chunks(checkpoint: str):
    engine = tiny_engine(checkpoint, False)
    engine.add_request("asks", tiny_prompt(12, 5), SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1))
    engine.add_request("plain", tiny_prompt(5, 6), SamplingParams(max_tokens=3, temperature=0))
    rows = []
    while engine.has_work():
        batch = engine.schedule()
        rows.append(logits_rows(batch))
        prepared = engine.runner.prepare(batch)
        assert prepared.logits_indices.shape[0] == sum(rows[-1])
        if batch.is_decode_only:
            assert rows[-1] == [1] * len(batch.seqs)  # decode steps (and their CUDA graphs) are unchanged
        engine.execute(batch)
    assert rows[:2] == [[8], [4, 1]]  # the prompt in chunks of 8 and 4 (with every row), beside "plain"'s first 4
    assert logits_rows(ScheduledBatch()) == []
