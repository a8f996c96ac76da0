"""No request's numbers can hurt the other users (docs/reliability.md), on 127.0.0.1 only:

- SamplingParams accepts exactly the ranges of vLLM's SamplingParams._verify_args (vllm/sampling_params.py
  at vllm-project/vllm@00388f6573ccfcffad607b8c9ecdf341a4669ceb; the differences serving/engine/sequence.py
  names), transcribed below as an oracle;
- the sampler (hypothesis): any SamplingParams the API accepts, on logits scaled up to float32's largest
  and holding NaN and ±inf, with penalties over a token history. Every row gets a token in the vocabulary,
  torch.multinomial never sees an invalid distribution, and the token obeys the rules of
  serving/engine/sampling.py's docstring, checked against an oracle that computes the penalties and the
  temperature element by element in numpy float32; a row without inf or NaN is unaffected by the others;
- the engine (tests/reliability_fakes.py): a request whose own host work raises (a token its tokenizer
  cannot decode, its token counts, its logprobs, its last text on an abort) ends alone with an error;
  the others get exactly their tokens and the blocks and token counts come back;
- HTTP, the fake model with NaN and ±inf logits: strictly valid JSON and SSE (no NaN), the documented
  tokens; a request the engine fails on is a 500 naming it (or an SSE error event), the engine serves on;
- HTTP, the built-in tiny DeepSeek-V3: every numeric field of /v1/completions and /v1/chat/completions at
  the extremes (0, subnormal, 1e-38, 1e308, negative, NaN, ±Infinity, 2^63, 2^64, -1), greedy and sampled,
  with and without logprobs, streamed or not: a 200 exactly where the oracle of valid ranges says, else a
  400 naming the field; never a 5xx; afterwards a greedy request still gets its earlier text.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import queue
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_fakes import (
    CURSE_ROW,
    DEAD_ROW,
    INF_ROW,
    INF_TOKENS,
    NAN_ROW,
    UNDECODABLE,
    NumbersModel,
    PickyTokenizer,
)
from serving_fakes import EOS, VOCAB, reference_greedy
from test_serving_api import check_envelope, fake_server
from test_serving_api import tiny_server as serve_tiny_model
from test_serving_engine import prompt_of, run, tokens

from serving.api.protocol import INT64_MIN, MAX_N, UINT64_MAX
from serving.api.server import ServerState
from serving.engine import engine as engine_module
from serving.engine.engine import LLMEngine
from serving.engine.messages import RequestOutput
from serving.engine.sampling import Sampler, TokenCounts
from serving.engine.sequence import MAX_LOGPROBS, PENALTY_RANGE, BadRequest, SamplingParams

CASES: Counter[str] = Counter()  # requests and examples, by test (and status), for docs/reliability.md
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])

@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    print(f"cases: {dict(sorted(CASES.items()))}")


# ---------------------------------------------------------------------------- the oracle of valid values
# vLLM's ranges (module docstring), as they apply to a value of the request's JSON: Python's chained
# comparisons are False for NaN, as vLLM's are. A float field takes ints too (pydantic's float), an int
# field only ints.
FLOAT_RANGES: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0 and math.isfinite(v),  # no upper bound here (vLLM: <= 2)
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "presence_penalty": lambda v: -PENALTY_RANGE <= v <= PENALTY_RANGE,
    "frequency_penalty": lambda v: -PENALTY_RANGE <= v <= PENALTY_RANGE,
    "repetition_penalty": lambda v: v > 0 and math.isfinite(v),
}
INT_RANGES: dict[str, Callable[[int], bool]] = {
    "top_k": lambda v: v >= -1,
    "max_tokens": lambda v: v >= 1,
    "logprobs": lambda v: 0 <= v <= MAX_LOGPROBS,
    "prompt_logprobs": lambda v: 0 <= v <= MAX_LOGPROBS,
}
EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-38, 1e-5, 0.5, 1.0, 2.0, 2.5, 3.5e38, 1e308, -5e-324, -1e-38, -1.0,
                  -2.0, -2.5, -1e308, math.nan, math.inf, -math.inf]
EXTREME_INTS = [0, 1, 2, -1, -2, MAX_LOGPROBS, MAX_LOGPROBS + 1, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63)]


def test_sampling_params_accept_exactly_vllms_ranges():
    for field, valid in [*FLOAT_RANGES.items(), *INT_RANGES.items()]:
        values = EXTREME_FLOATS if field in FLOAT_RANGES else EXTREME_INTS
        for value in values:
            CASES["SamplingParams"] += 1
            if valid(value):
                SamplingParams(**{field: value})
                continue
            with pytest.raises(BadRequest, match=field) as info:
                SamplingParams(**{field: value})
            assert info.value.param == field, (field, value)
    with pytest.raises(BadRequest, match="top_k") as info:
        SamplingParams(top_k=2.0)  # vLLM: top_k must be an integer
    assert info.value.param == "top_k"


# ---------------------------------------------------------------------------- the sampler
F32 = np.float32
SMALLEST_F32, LARGEST_F32 = 2.0 ** -149, float(np.finfo(np.float32).max)


def as_factor(value: float) -> np.float32:
    """A temperature or repetition penalty as the sampler takes it: clamped into float32's positive range."""
    return F32(min(max(value, SMALLEST_F32), LARGEST_F32))


def first_max(values: np.ndarray) -> int | None:
    """The first index of the largest value, NaN left out; None where nothing is above -inf."""
    best = None
    for t, v in enumerate(values):
        if not math.isnan(v) and v > -math.inf and (best is None or v > values[best]):
            best = t
    return best


def penalized_f32(raw: np.ndarray, p: SamplingParams, prompt: set[int], counts: dict[int, int]) -> np.ndarray:
    """vLLM's penalties (apply_penalties), token by token in float32: the same roundings as the device."""
    if not p.penalized:
        return raw.copy()
    r, f, pr = as_factor(p.repetition_penalty), F32(p.frequency_penalty), F32(p.presence_penalty)
    out = np.empty_like(raw)
    with np.errstate(all="ignore"):
        for t, x in enumerate(raw):
            c = counts.get(t, 0)
            if t in prompt or c:
                x = x / r if x > 0 else x * r
            out[t] = x - f * F32(c) - pr * F32(c > 0)
    return out


def check_row(token: int, raw: np.ndarray, p: SamplingParams, prompt: set[int], counts: dict[int, int],
              what: str) -> bool:
    """The rules of sampling.py's docstring for one row; whether the row stayed finite all the way."""
    fallback = first_max(raw)
    fallback = 0 if fallback is None else fallback
    x = penalized_f32(raw, p, prompt, counts)
    if p.greedy:
        best = first_max(x)
        assert token == (fallback if best is None else best), what
        return bool(np.isfinite(raw).all() and np.isfinite(x).all())
    with np.errstate(all="ignore"):
        y = x / as_factor(p.temperature)
    inf = [t for t in range(len(y)) if y[t] == math.inf]
    values = {t: 0.0 for t in inf} if inf else {t: float(v) for t, v in enumerate(y) if math.isfinite(v)}
    if not values:
        assert token == fallback, what
        return False
    assert token in values, what
    top = max(values.values())
    if 0 < p.top_k < len(y):
        ranked = sorted(values.values(), reverse=True)
        assert values[token] >= (ranked[p.top_k - 1] if p.top_k <= len(ranked) else -math.inf), what
    probs = {t: math.exp(v - top) for t, v in values.items()}  # unnormalised, float64
    assert probs[token] >= p.min_p * (1 - 1e-3) - 1e-37, what  # float32 rounding's slack
    if p.top_p <= 1 / (2 * len(y)):  # the top-p set is one token: a likeliest one
        assert values[token] == top, what
    return not inf and bool(np.isfinite(raw).all() and np.isfinite(x).all() and np.isfinite(y).all())


def checked_multinomial(probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.multinomial, after checking what a GPU would assert on."""
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()) and float(probs.sum()) > 0, probs
    return REAL_MULTINOMIAL(probs, *args, **kwargs)


REAL_MULTINOMIAL = torch.multinomial
TEMPERATURE = st.sampled_from([0.0, 5e-324, 1e-300, 1e-5, 1e-3, 0.7, 1.0, 2.0, 1e30, 1e308]) | st.floats(0, 1e308)
REPETITION = st.sampled_from([1.0, 5e-324, 1e-45, 1e-38, 1e-3, 0.5, 2.0, 1e38, 1e308]) | st.floats(5e-324, 1e308)
PENALTY = st.sampled_from([0.0, -PENALTY_RANGE, PENALTY_RANGE]) | st.floats(-PENALTY_RANGE, PENALTY_RANGE)
PARAMS = st.builds(SamplingParams, temperature=TEMPERATURE, top_p=st.sampled_from([1.0, 5e-324, 1e-38, 0.5])
                   | st.floats(5e-324, 1.0), top_k=st.integers(-1, VOCAB + 5) | st.integers(-1, 1 << 80),
                   min_p=st.sampled_from([0.0, 5e-324, 1.0]) | st.floats(0, 1), repetition_penalty=REPETITION,
                   presence_penalty=PENALTY, frequency_penalty=PENALTY,
                   logprobs=st.none() | st.integers(0, MAX_LOGPROBS), seed=st.none() | st.integers(0, 1 << 62))
DAMAGE = ["none", "none", "nan", "posinf", "neginf", "mixed", "all-nan", "all-neginf", "dead", "few"]


def damaged_row(data: st.DataObject, scale: float) -> tuple[torch.Tensor, list[int]]:
    """Random logits at `scale` (float32 overflows to inf past 3.4e38), with NaN and ±inf put in: at a few
    spots, or everywhere ("dead": nothing but -inf and NaN; "few": -inf but at the spots, which are
    negative: a large repetition_penalty on them leaves no candidate). The row, and its spots."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 1 << 30)))) * scale
    kind = data.draw(st.sampled_from(DAMAGE))
    spots = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    nan, inf = math.nan, math.inf
    if kind == "mixed":
        row[spots] = torch.tensor([(nan, inf, -inf)[i % 3] for i in range(len(spots))])
    elif kind in ("nan", "posinf", "neginf"):
        row[spots] = {"nan": nan, "posinf": inf, "neginf": -inf}[kind]
    elif kind == "few":
        row = torch.where(torch.isin(torch.arange(VOCAB), torch.tensor(spots)), -row.abs() - 1, -inf)
    elif kind in ("all-nan", "all-neginf", "dead"):
        row[:] = nan if kind == "all-nan" else -inf
        if kind == "dead":
            row[spots] = nan
    return row, spots


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_the_sampler_takes_any_parameters_the_api_accepts_on_any_logits(data):
    rows = data.draw(st.integers(1, 4))
    params = [data.draw(PARAMS) for _ in range(rows)]
    scale = data.draw(st.sampled_from([1.0, 1e-3, 1e3, 1e30, 3e38]))
    damaged = [damaged_row(data, scale) for _ in range(rows)]
    logits = torch.stack([row for row, _ in damaged])
    # Each penalized row's history: a prompt (at times holding the row's spots) and output counts.
    histories = {i: (set(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)))
                     | set(damaged[i][1] if data.draw(st.booleans()) else ()),
                     Counter(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))))
                 for i, p in enumerate(params) if p.penalized}

    def sample(which: list[int]) -> Any:
        counts = TokenCounts(VOCAB, "cpu")
        penalized = [j for j, i in enumerate(which) if i in histories]
        slots = [counts.assign(sorted(histories[which[j]][0]), list(histories[which[j]][1].elements()))
                 for j in penalized]
        history = counts.history(penalized, slots) if penalized else None
        gens = [None if params[i].seed is None else torch.Generator().manual_seed(params[i].seed) for i in which]
        with mock.patch.object(torch, "multinomial", checked_multinomial):
            return Sampler("cpu").run(logits[which].clone(), [params[i] for i in which], gens, history)

    CASES["sampler"] += 1
    out = sample(list(range(rows)))
    got = out.tokens.tolist()
    for i, p in enumerate(params):
        assert 0 <= got[i] < VOCAB
        prompt, counts = histories.get(i, (set(), Counter()))
        what = f"row {i}: token {got[i]}, {p}, logits {logits[i].tolist()}"
        fine = check_row(got[i], logits[i].numpy(), p, prompt, counts, what)
        if fine and p.seed is not None and rows > 1:  # the other rows do not change a row's draw
            assert got[i] == int(sample([i]).tokens[0]), what
        if p.logprobs is not None:
            values = out.logprob_values[out.logprob_rows[i]]
            assert not bool(values.isnan().any()) and bool((values <= 0).all()), (what, values)
            assert int(out.logprob_ids[out.logprob_rows[i], 0]) == got[i]


def test_each_rule_of_the_sampler_on_a_row_built_for_it():
    nan, inf = math.nan, math.inf
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)

    def one(row: list[float], p: SamplingParams, prompt: list[int] | None = None, seed: int = 0) -> int:
        counts = TokenCounts(len(row), "cpu")
        history = counts.history([0], [counts.assign(prompt)]) if prompt is not None else None
        with mock.patch.object(torch, "multinomial", checked_multinomial):
            out = Sampler("cpu").run(torch.tensor([row]), [p], [torch.Generator().manual_seed(seed)], history)
        return int(out.tokens[0])

    # NaN excludes its token.
    assert one([nan, 1.0, 3.0, nan, 2.0], greedy) == 2
    assert {one([nan, 1.0, 3.0, nan, 2.0], SamplingParams(temperature=1.0, top_k=1), seed=s) for s in range(20)} == {2}
    # +inf: tied as the likeliest, the only candidates: greedy takes the first, sampling draws uniformly.
    assert one([1.0, inf, 0.0, inf], greedy) == 1
    draws = Counter(one([1.0, inf, 0.0, inf, nan], sampled, seed=s) for s in range(400))
    assert set(draws) == {1, 3} and 140 < draws[1] < 260, draws  # binomial(400, 1/2): 6 sigma
    # A finite logit that overflows: after the temperature, or after a repetition_penalty.
    assert set(one([3e38, 1e38, -1.0, 2e38], SamplingParams(temperature=1e-5), seed=s) for s in range(60)) == {0, 1, 3}
    assert one([4.0, 9.0, 5.0], SamplingParams(temperature=0.0, repetition_penalty=1e-38), prompt=[0, 2]) == 0
    # A factor beyond float32's range is its nearest float32 (1e308 is not inf: 0 x 1e308 is 0, not NaN).
    assert one([0.0, -1.0], SamplingParams(temperature=0.0, repetition_penalty=1e308), prompt=[0]) == 0
    # No candidate left after the penalties: the argmax of the raw logits.
    row = [-3.0, -2.5, -2.0, -4.0, -inf, nan]
    for p in (greedy, sampled, SamplingParams(temperature=0.5, top_p=1e-9, min_p=1.0)):
        assert one(row, dataclasses.replace(p, repetition_penalty=1e308), prompt=[0, 1, 2, 3]) == 2
    # No candidate at all, raw logits included: token 0.
    for p in (greedy, sampled):
        assert one([nan, -inf, nan, -inf], p) == 0 and one([nan] * 4, p) == 0
    # Logprobs: NaN reads -inf; a finite row's are log_softmax's.
    logits = torch.tensor([[nan, 1.0, 2.0], [0.0, 1.0, 2.0], [1.0, inf, 0.0]])
    out = Sampler("cpu").run(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 3, [None] * 3)
    assert out.tokens.tolist() == [2, 2, 1]
    assert out.logprob_values[0].tolist() == [-inf] * 3 and out.logprob_values[2].tolist() == [-inf] * 3
    want = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64).log_softmax(0)
    assert out.logprob_values[1].tolist() == pytest.approx(want[[2, 2, 1]].tolist(), abs=1e-6)


# ---------------------------------------------------------------------------- the engine
def numbers_engine(async_scheduling: bool) -> LLMEngine:
    return LLMEngine(NumbersModel(8), PickyTokenizer(), num_blocks=256, block_size=4, max_model_len=128,
                     max_num_seqs=8, max_tokens_per_rank=8, device=torch.device("cpu"),
                     async_scheduling=async_scheduling)


GOOD = {"greedy": (prompt_of(5), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        "seeded": (prompt_of(9, 1), SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True,
                                                   logprobs=2, presence_penalty=0.5)),
        "penalized": (prompt_of(4, 2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                      repetition_penalty=1.5, logprobs=0))}
FAULTS = {  # the failing request, and how its own host work is made to raise
    "decode": ([5, 6, CURSE_ROW], SamplingParams(max_tokens=6, temperature=0.0)),  # UNDECODABLE comes next
    "token counts": ([7, 8, 9], SamplingParams(max_tokens=6, frequency_penalty=1.0)),
    "logprobs": ([7, 8, 9], SamplingParams(max_tokens=6, logprobs=3)),
    "abort": ([7, 8, 9], SamplingParams(max_tokens=60, ignore_eos=True)),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@BOTH_MODES
def test_a_request_whose_own_work_raises_ends_alone(fault: str, async_scheduling: bool,
                                                    monkeypatch: pytest.MonkeyPatch):
    want = {rid: tokens(run(numbers_engine(async_scheduling), {rid: req})[rid]) for rid, req in GOOD.items()}
    engine = numbers_engine(async_scheduling)
    bad_prompt, bad_params = FAULTS[fault]
    if fault == "token counts":
        assign = engine.token_counts.assign

        def picky_assign(prompt: list[int], output: list[int] = ()) -> int:
            if list(prompt) == bad_prompt:
                raise IndexError("token counts (on purpose)")
            return assign(prompt, output)
        monkeypatch.setattr(engine.token_counts, "assign", picky_assign)
    elif fault == "logprobs":
        logprobs = engine_module._logprobs
        monkeypatch.setattr(engine_module, "_logprobs",
                            lambda ids, values, rank, k: logprobs(ids, values, rank, k) if k != 3 else 1 / 0)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in [*GOOD, "bad"]}
    for rid, (prompt, params) in [*GOOD.items(), ("bad", (bad_prompt, bad_params))]:
        engine.add_request(rid, prompt, params)
    for _ in range(500):
        if not engine.has_work():
            break
        if fault == "abort" and len(outs["bad"]) == 3:
            monkeypatch.setattr(engine.requests["bad"].text, "take", lambda finished: 1 / 0)
            outs["bad"].append(engine.abort("bad"))
        for out in engine.step():
            outs[out.request_id].append(out)
    assert not engine.has_work()
    last = outs["bad"][-1]
    assert last.finish_reason == "abort" and last.internal_error and last.error is not None, last
    assert "request bad: internal error" in last.error and "(on purpose)" not in last.error, last.error
    assert all(o.error is None for o in outs["bad"][:-1]) and sum(o.finished for o in outs["bad"]) == 1
    for rid in GOOD:
        assert tokens(outs[rid]) == want[rid], rid
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].error is None
    assert want["greedy"] == reference_greedy(GOOD["greedy"][0], 12, ignore_eos=True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.token_counts.num_assigned == 0 and not engine.requests
    CASES["engine faults"] += 1


# ---------------------------------------------------------------------------- HTTP: the fake model's numbers
def strict_json(text: str) -> Any:
    """json.loads refusing NaN and ±Infinity, which are not JSON (RFC 8259)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a response: {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def strict_events(text: str) -> list[Any]:
    """An SSE body's events ("data: " lines), each parsed by strict_json but the final [DONE]."""
    events = []
    for line in filter(None, text.splitlines()):
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else strict_json(data))
    return events


@pytest.fixture(scope="module")
def numbers_server() -> Iterator[tuple[str, ServerState]]:
    with fake_server(model="fake-numbers", loader="reliability_fakes") as served:
        yield served


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("row", [NAN_ROW, INF_ROW, DEAD_ROW], ids=["nan", "inf", "dead"])
def test_nan_and_inf_logits_give_valid_json_and_the_documented_tokens(numbers_server, row: int, stream: bool):
    prompt = [5, 6, row]
    with httpx.Client(base_url=numbers_server[0], timeout=30) as c:
        for temperature in (0.0, 1.0):
            body = {"prompt": prompt, "max_tokens": 3, "temperature": temperature, "seed": 3, "logprobs": 3,
                    "ignore_eos": True, "stream": stream}
            resp = c.post("/v1/completions", json=body)
            CASES[f"nan/inf logits {resp.status_code}"] += 1
            assert resp.status_code == 200, resp.text
            if stream:
                events = strict_events(resp.text)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
                choices = [e["choices"][0] for e in events[:-1]]
            else:
                choices = strict_json(resp.text)["choices"]
            text = "".join(ch["text"] for ch in choices)
            logprobs = [lp for ch in choices for lp in ch["logprobs"]["token_logprobs"]]
            # The first token: all NaN, or nothing but -inf and NaN: no candidate, and no raw logit is a
            # number either: token 0; +inf at INF_TOKENS: one of them, the first when greedy.
            if row == INF_ROW:
                first = text[0]
                assert first in [chr(ord("a") + t - 2) for t in INF_TOKENS], text
                assert first == "a" or temperature > 0, text
                first_id = ord(first) - ord("a") + 2
            else:
                first_id = EOS
            assert logprobs[0] == -9999.0, logprobs  # NaN read as -inf, reported as -9999
            assert all(-9999.0 <= lp <= 0 for lp in logprobs), logprobs
            if temperature == 0:
                rest = reference_greedy([*prompt, first_id], 2, ignore_eos=True)
                assert text == PickyTokenizer().decode([first_id, *rest]), (text, rest)


def test_a_request_the_engine_fails_on_is_a_500_and_the_others_are_served(numbers_server):
    url, state = numbers_server
    good = {"prompt": prompt_of(6), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    want = PickyTokenizer().decode(reference_greedy(prompt_of(6), 200, ignore_eos=True))
    assert UNDECODABLE not in reference_greedy(prompt_of(6), 200, ignore_eos=True)
    started, result = threading.Event(), {}

    def stream_good() -> None:
        with httpx.Client(base_url=url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={**good, "stream": True}) as resp:
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                started.set()
            result["events"] = strict_events("\n".join(lines))

    thread = threading.Thread(target=stream_good)
    thread.start()
    assert started.wait(30)
    with httpx.Client(base_url=url, timeout=30) as c:
        cursed = {"prompt": [5, 6, CURSE_ROW], "max_tokens": 4, "temperature": 0}
        err = check_envelope(c.post("/v1/completions", json=cursed), 500)
        assert err["type"] == "InternalServerError" and "internal error (ValueError)" in err["message"], err
        assert "request cmpl-" in err["message"] and "on purpose" not in err["message"], err
        streamed = c.post("/v1/completions", json={**cursed, "stream": True})
        assert streamed.status_code == 200, streamed.text
        events = strict_events(streamed.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500, events
        assert "internal error (ValueError)" in events[-2]["error"]["message"]
        thread.join(60)
        text = "".join(e["choices"][0]["text"] for e in result["events"][:-1])
        assert result["events"][-1] == "[DONE]" and text == want
        assert c.get("/health").status_code == 200 and state.coordinator.alive
        again = c.post("/v1/completions", json={**good, "max_tokens": 20}).json()
        assert again["choices"][0]["text"] == PickyTokenizer().decode(
            reference_greedy(prompt_of(6), 20, ignore_eos=True))
    CASES["engine fails on a request"] += 3


# ---------------------------------------------------------------------------- HTTP: the tiny model, at the extremes
TINY = "tiny-sampling"
CONCURRENT = 4  # requests in flight at once
SAMPLED_ONLY = ("top_p", "top_k", "min_p")  # fields that greedy requests do not use
COMPLETION = {"model": TINY, "prompt": "Hello there", "max_tokens": 2}
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
HTTP_FLOATS = [0.0, -0.0, 5e-324, 1e-38, 0.5, 1, 2.0, 2.5, 1e308, -5e-324, -1, -2.5, math.nan, math.inf, -math.inf,
               1 << 63, 1 << 64]
HTTP_INTS = [0, 1, 2, -1, -2, MAX_LOGPROBS, MAX_LOGPROBS + 1, MAX_N + 1, (1 << 63) - 1, 1 << 63, 1 << 64,
             -(1 << 63) - 1, 1.0, 5e-324, math.nan, math.inf]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[tuple[str, ServerState]]:
    from serving.tiny_model import tiny_checkpoint

    path = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-cache")))
    with serve_tiny_model(path, served_model_name=TINY) as served:
        yield served


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_float(v: Any) -> bool:
    """A JSON number pydantic takes as a float: a float, or an int a float can hold."""
    return isinstance(v, float) or (is_int(v) and abs(v) < 1 << 1023)


def valid(body: dict, field: str, value: Any, room: int) -> bool:
    """Whether the server must serve `body` (one field at an extreme); room: max_model_len - prompt tokens."""
    if field in FLOAT_RANGES:
        return is_float(value) and FLOAT_RANGES[field](float(value))
    if not is_int(value):
        return False
    if field in ("max_tokens", "max_completion_tokens"):
        return 1 <= value <= room
    if field == "top_logprobs":
        return bool(body.get("logprobs")) and INT_RANGES["logprobs"](value)
    return {"top_k": INT_RANGES["top_k"], "logprobs": INT_RANGES["logprobs"], "n": lambda v: 1 <= v <= MAX_N,
            "seed": lambda v: INT64_MIN <= v <= UINT64_MAX}[field](value)


def check_served(resp: httpx.Response, body: dict, what: str) -> str:
    """A 200 whose JSON (or SSE) is strictly valid, every choice finished without an error; the text of
    choice 0."""
    assert resp.status_code == 200, (what, resp.text)
    if body.get("stream"):
        events = strict_events(resp.text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), (what, events[-3:])
        chunks = [c for e in events[:-1] for c in e["choices"]]
        assert sorted(c["index"] for c in chunks if c["finish_reason"]) == list(range(body.get("n", 1))), what
        return "".join(c.get("text", c.get("delta", {}).get("content", "")) for c in chunks if c["index"] == 0)
    choices = strict_json(resp.text)["choices"]
    assert all(c["finish_reason"] in ("length", "stop") for c in choices), what
    return choices[0].get("text", choices[0].get("message", {}).get("content"))


@pytest.mark.slow
def test_every_numeric_field_at_the_extremes_is_a_200_or_a_400_naming_it(tiny_server, seed: int):
    url, state = tiny_server
    rng = random.Random(seed)
    fields = {"completions": [*FLOAT_RANGES, "top_k", "max_tokens", "n", "seed", "logprobs"],
              "chat/completions": [*FLOAT_RANGES, "top_k", "max_tokens", "max_completion_tokens", "n", "seed",
                                   "top_logprobs"]}
    clients: queue.SimpleQueue[httpx.Client] = queue.SimpleQueue()
    for _ in range(CONCURRENT):
        clients.put(httpx.Client(base_url=url, timeout=120))

    def post(endpoint: str, body: dict) -> httpx.Response:
        c = clients.get()
        try:  # encoded here: NaN and Infinity go out as Python's json writes them
            return c.post(f"/v1/{endpoint}", content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"})
        finally:
            clients.put(c)

    greedy = post("completions", {**COMPLETION, "temperature": 0, "max_tokens": 8}).json()["choices"][0]["text"]
    cases = []  # (endpoint, body, field, value, room)
    for endpoint, names in fields.items():
        base = COMPLETION if endpoint == "completions" else CHAT
        prompt = {k: v for k, v in base.items() if k in ("model", "prompt", "messages")}
        room = state.max_model_len - httpx.post(f"{url}/tokenize", json=prompt).json()["count"]
        for field in names:
            values = HTTP_FLOATS if field in FLOAT_RANGES else HTTP_INTS
            if field.startswith("max_"):  # a valid one is that many tokens: the small ones are enough
                values = [v for v in values if not 2 < abs(v) < 1 << 62]
            for value in values:
                # Greedy and sampled where the field acts on both (penalties), sampled where it acts on
                # sampling alone, either for the others.
                temperatures = (0.0, 1.0) if field.endswith("_penalty") else (1.0,) if field in SAMPLED_ONLY \
                    else (rng.choice((0.0, 1.0)),)
                for temperature in temperatures:
                    body = {**base, "temperature": temperature, "seed": rng.randrange(1 << 32),
                            "stream": rng.random() < 0.5}
                    if rng.random() < 0.5:
                        body.update({"logprobs": 2} if endpoint == "completions" else
                                    {"logprobs": True, "top_logprobs": 2})
                    cases.append((endpoint, {**body, field: value}, field, value, room))
    # A few at a time: extreme requests share the engine's batches with each other.
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda case: post(case[0], case[1]), cases))
    for (endpoint, body, field, value, room), resp in zip(cases, answers):
        what = f"seed={seed}: /v1/{endpoint} {field}={value!r}: {body}"
        CASES[f"extremes {resp.status_code}"] += 1
        if valid(body, field, value, room):
            check_served(resp, body, what)
        else:
            assert check_envelope(resp, 400)["param"] == field, (what, resp.text)
    again = post("completions", {**COMPLETION, "temperature": 0, "max_tokens": 8}).json()["choices"][0]["text"]
    assert again == greedy
    assert httpx.get(f"{url}/health").status_code == 200 and state.coordinator.alive
    while not clients.empty():
        clients.get().close()
