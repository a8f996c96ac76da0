"""benchmarks/bench_serving.py's mixed workload without a GPU: the generator (lengths, arrivals, prompts) on
its own, the statistics against hand-computed values, and two short runs against the built-in tiny model:
launched by the benchmark, and as any OpenAI-compatible server (--backend openai, an API key)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from deploy_helpers import ROOT, EPServe, scrape, total

_BENCHMARKS = str(ROOT / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbour serving_workloads by name

import bench_serving as bench  # noqa: E402
import serving_workloads as wl  # noqa: E402

# OpenAI's request fields of /v1/completions and /v1/chat/completions that the benchmark may send.
OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options", "logprobs",
                 "top_logprobs"}


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    from serving.tiny_model import tiny_checkpoint

    cache = str(tmp_path_factory.mktemp("tiny-cache"))
    tiny_checkpoint(cache)  # written before a server starts
    return cache


# ---------------------------------------------------------------------------- the generator
def test_the_same_seed_draws_the_same_workload(seed: int) -> None:
    a = wl.mixed_workload(300, seed, rate=3.0)
    assert a == wl.mixed_workload(300, seed, rate=3.0), f"seed={seed}"
    assert a[:100] == wl.mixed_workload(100, seed, rate=3.0), "a request's draws depend on how many are sent"
    assert a != wl.mixed_workload(300, seed + 1, rate=3.0)
    other_rate = wl.mixed_workload(300, seed, rate=6.0)
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in other_rate]
    assert all(math.isclose(x.arrival_s, 2 * y.arrival_s, abs_tol=1e-12) for x, y in zip(a, other_rate))
    assert wl.prompt_text(seed, "s", 7, 50) == wl.prompt_text(seed, "s", 7, 50)
    assert wl.prompt_text(seed, "s", 7, 50) != wl.prompt_text(seed + 1, "s", 7, 50)


@pytest.mark.parametrize(("max_model_len", "reserve"), [(100_000, 0), (4096, 1), (1024, 40), (256, 1), (40, 0)])
def test_lengths_stay_in_their_ranges_and_fit_max_model_len(seed: int, max_model_len: int, reserve: int) -> None:
    workload = wl.mixed_workload(2000, seed, (16, 2000), (16, 512), max_model_len, reserve)
    for r in workload:
        assert 16 <= r.prompt_len <= 2000 and 1 <= r.output_len <= 512, (seed, r)
        assert r.prompt_len + r.output_len + reserve <= max_model_len, (seed, r)
    if max_model_len == 100_000:  # untrimmed: log-uniform, so half the prompts are below the geometric mean
        below = sum(r.prompt_len < math.sqrt(16 * 2001) for r in workload) / len(workload)
        assert abs(below - 0.5) < 6 * 0.5 / math.sqrt(len(workload)), f"seed={seed}: {below:.3f} below"


def test_fit_ranges_trims_the_output_first_and_refuses_what_cannot_fit() -> None:
    assert wl.fit_ranges((16, 2000), (16, 512), 4096) == ((16, 2000), (16, 512))
    assert wl.fit_ranges((16, 2000), (16, 512), 1024, 1) == ((16, 511), (16, 512))
    assert wl.fit_ranges((16, 2000), (16, 512), 256, 1) == ((16, 16), (16, 239))
    with pytest.raises(ValueError, match="no room"):
        wl.fit_ranges((16, 2000), (16, 512), 16)


def test_log_uniform_covers_its_ends(seed: int) -> None:
    rng = random.Random(seed)
    draws = [wl.log_uniform(rng, 3, 6) for _ in range(4000)]
    assert set(draws) == {3, 4, 5, 6}, f"seed={seed}"  # each with probability ln((k + 1) / k) / ln(7 / 3)
    for k in (3, 4, 5, 6):
        p = math.log((k + 1) / k) / math.log(7 / 3)
        assert abs(draws.count(k) / 4000 - p) < 6 * math.sqrt(p * (1 - p) / 4000), f"seed={seed}, k={k}"


def test_poisson_arrivals_have_mean_gap_one_over_the_rate(seed: int) -> None:
    rate = random.Random(seed).uniform(0.5, 50.0)
    n = 20_000
    times = wl.arrival_times(seed, n, rate)
    gaps = bench.token_gaps(times)  # differences of successive values
    assert times[0] == 0.0 and min(gaps) >= 0
    # The mean of n - 1 exponential gaps has standard deviation (1 / rate) / sqrt(n - 1); so has their spread.
    assert abs(statistics.fmean(gaps) * rate - 1) < 6 / math.sqrt(n - 1), f"seed={seed}, rate={rate}"
    assert abs(statistics.stdev(gaps) * rate - 1) < 0.1, f"seed={seed}, rate={rate}"
    assert wl.arrival_times(seed, 5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        wl.arrival_times(seed, 5, 0.0)


def test_token_prompts_are_exact_unique_at_the_start_and_repeatable(seed: int) -> None:
    calls: list[int] = []

    async def tokenize(text: str) -> list[int]:  # bytes as tokens; like /tokenize, at most 64 at once
        ids = list(text.encode())
        calls.append(len(ids))
        assert len(ids) <= 64, "a chunk larger than /tokenize takes"
        return ids

    async def prompts(salt: str) -> list[list[int]]:
        return [await wl.token_prompt(tokenize, seed, salt, r.index, r.prompt_len, chunk_words=6)
                for r in wl.mixed_workload(200, seed, (16, 300), (16, 16))]

    first, again, other = asyncio.run(prompts("run-a")), asyncio.run(prompts("run-a")), asyncio.run(prompts("run-b"))
    workload = wl.mixed_workload(200, seed, (16, 300), (16, 16))
    assert [len(p) for p in first] == [r.prompt_len for r in workload], f"seed={seed}"
    assert first == again
    starts = [tuple(p[:16]) for p in first + other]  # a KV block of 16 tokens
    assert len(set(starts)) == len(starts), "two prompts share their first 16 tokens"
    text = bytes(first[3]).decode()
    assert text.startswith(wl.unique_word("run-a", 3) + " ") and all(w in wl.WORDS for w in text.split()[1:-1])


def mock_server(tokenizes: bool) -> httpx.AsyncClient:
    """A client of a server whose /tokenize makes a token of each byte (or, without, answers 404)."""

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize" and tokenizes:
            return httpx.Response(200, json={"tokens": list(body["prompt"].encode())})
        if request.url.path == "/detokenize" and tokenizes:
            return httpx.Response(200, json={"text": bytes(body["tokens"]).decode()})  # SGLang's key
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(answer))


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_on_the_servers_tokenizer_or_of_words_without_one(seed: int, chat: bool) -> None:
    first = wl.prompt_text(seed, "first", 0, 15)
    request = wl.WorkloadRequest(4, 40, 16, 0.0)

    async def make(tokenizes: bool, first_prompt_tokens: int | None) -> tuple[str | list[int], int, str]:
        async with mock_server(tokenizes) as client:
            maker, reserve, how = await wl.prompt_maker(client, "m", chat, seed, first, first_prompt_tokens, 4096)
            return await maker.make(request, "salt"), reserve, how

    prompt, reserve, how = asyncio.run(make(True, len(first.encode()) + 3))  # the server added 3 tokens
    assert reserve == (3 + 8 if chat else 3) and "/tokenize" in how
    ids = list(prompt.encode()) if chat else prompt
    assert ids == asyncio.run(wl.token_prompt(mock_tokenize, seed, "salt", 4, 40))
    prompt, reserve, how = asyncio.run(make(False, 32))  # 16 words made 32 tokens
    assert reserve == (64 if chat else 16) and "approximate" in how
    assert prompt == wl.prompt_text(seed, "salt", 4, 19)  # 40 tokens at 2 a word: the unique word and 19


async def mock_tokenize(text: str) -> list[int]:
    return list(text.encode())


# ---------------------------------------------------------------------------- what a level reports
def test_percentile_is_the_nearest_rank() -> None:
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 3.0  # index round(1.5) = 2
    assert bench.percentile([float(v) for v in range(1, 101)], 99) == 99.0  # index round(98.01) = 98
    assert bench.percentile([float(v) for v in range(1, 11)], 99) == 10.0
    assert math.isnan(bench.percentile_or_nan([], 50))


def test_step_floor_reads_each_activated_expert_once(tmp_path: Path) -> None:
    """The weight bytes of a step, against counts made here: one token reads the dense weights and top_k experts
    a MoE layer; a step of many tokens nearly all of them; a prompt of T tokens the expected number of distinct
    experts that T uniform top-k draws hit (a seeded simulation); a decode step of t tokens on each of R ranks
    is a step of t * R tokens, each rank reading its share."""
    from serving.loading.checkpoint import load_config
    from serving.random_weights import stored_bytes
    from serving.tiny_model import write_v3_shaped

    model = Path(write_v3_shaped(tmp_path, 3))
    config = load_config(model)
    experts, topk = config.n_routed_experts, config.num_experts_per_tok
    sizes = dict(stored_bytes(config))
    mtp = f"model.layers.{config.num_hidden_layers}."
    expert_layer = [n for n in sizes if ".mlp.experts." in n and not n.startswith(mtp)]
    one_expert = sum(sizes[n] for n in expert_layer) / experts / (config.num_hidden_layers - 1)
    dense = sum(size for n, size in sizes.items() if ".mlp.experts." not in n and not n.startswith(mtp)
                and n != "model.embed_tokens.weight")
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    assert bench.step_bytes(model, 1, 1) == pytest.approx(dense + moe_layers * topk * one_expert, rel=1e-12)
    assert bench.step_bytes(model, 100_000, 1) == pytest.approx(dense + moe_layers * experts * one_expert, rel=1e-9)
    rng = random.Random(0)
    hit = statistics.mean(len({e for _ in range(32) for e in rng.sample(range(experts), topk)}) for _ in range(2000))
    assert bench.step_bytes(model, 32, 1) == pytest.approx(dense + moe_layers * hit * one_expert, rel=0.01)
    assert bench.decode_step_bytes(model, 4, 2) == bench.step_bytes(model, 8, 2)
    assert bench.step_bytes(model, 8, 2) == pytest.approx(dense + (bench.step_bytes(model, 8, 1) - dense) / 2)


def test_summary_of_a_level_by_hand() -> None:
    results = [bench.Timed(times=[0.100, 0.150, 0.300], latency=0.350, tokens=3, prompt_tokens=20),
               bench.Timed(times=[0.200, 0.220], latency=0.250, tokens=2, prompt_tokens=40),
               bench.Timed(times=[0.050], latency=0.060, tokens=1, prompt_tokens=30),
               bench.Timed(error="HTTP 400: too long")]
    assert bench.token_gaps(results[0].times) == pytest.approx([0.050, 0.150])
    row = bench.summarize(results, elapsed=2.0)
    assert (row["requests"], row["completed"], row["failed"]) == (4, 3, 1)
    assert row["prompt_tok"] == 30.0
    assert row["ttft_p50_ms"] == pytest.approx(100.0)  # TTFTs 50, 100, 200: the middle one
    assert row["ttft_p99_ms"] == pytest.approx(200.0)
    # TPOT (latency - TTFT) / (tokens - 1): 125 and 50 ms; the one-token request has none.
    assert row["tpot_p50_ms"] == pytest.approx(50.0)  # of [50, 125], index round(0.5) = 0
    assert row["tpot_p99_ms"] == pytest.approx(125.0)
    assert row["itl_p99_ms"] == pytest.approx(150.0)  # the gaps of all requests: 20, 50, 150 ms
    assert row["out_tok/s"] == pytest.approx(3.0)  # 6 tokens in 2 s
    assert math.isnan(bench.summarize([bench.Timed(error="x")], 1.0)["ttft_p50_ms"])


def test_after_the_opening_leaves_out_the_first_requests_sent_by_send_time() -> None:
    """The opening burst of a concurrency level is its first `c` requests by send time, whatever their order in the
    results; the figures are those of the later requests that completed."""
    def timed(sent_at: float, ttft: float, latency: float, tokens: int, error: str | None = None) -> bench.Timed:
        return bench.Timed(times=[ttft], latency=latency, tokens=tokens, sent_at=sent_at, error=error)

    results = [timed(5.0, 0.020, 0.120, 11), timed(0.0, 0.900, 1.000, 11), timed(0.1, 0.800, 0.900, 2),
               timed(6.0, 0.040, 0.080, 3), timed(7.0, 0, 0, 0, error="HTTP 500"), timed(8.0, 0.030, 0.030, 1)]
    later = bench.after_opening(results, concurrency=2)
    assert later["ttft_p50_ms"] == pytest.approx(30.0)  # of 20, 40, 30 (the failed one left out)
    assert later["ttft_p99_ms"] == pytest.approx(40.0)
    assert later["tpot_p50_ms"] == pytest.approx(10.0)  # of (120 - 20) / 10 and (80 - 40) / 2; none for one token
    assert later["tpot_p99_ms"] == pytest.approx(20.0)
    assert math.isnan(bench.after_opening(results[:2], concurrency=2)["ttft_p50_ms"])


@pytest.mark.parametrize(("chunk", "carries"), [
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, False),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, False),
    ({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, True),  # a token of incomplete UTF-8
    ({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}, True),
    ({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, False),
    ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}, False),
])
def test_which_chunks_carry_tokens(chunk: dict, carries: bool) -> None:
    assert bench.carries_tokens(chunk) is carries


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


@pytest.mark.parametrize(("status", "body", "want"), [
    (200, sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              *({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]} for _ in range(3)),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}, "[DONE]"),
     (3, 3, 7, None)),
    (200, sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}, "[DONE]"),
     (2, 2, None, None)),  # no usage: the chunks are counted
    (200, sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
              {"error": {"message": "boom", "code": 500}}, "[DONE]"), (1, 0, None, "error event")),
    (200, sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 0}}, "[DONE]"),
     (0, 0, 7, "without tokens")),
    (400, b'{"error": {"message": "ignore_eos: extra fields not permitted"}}', (0, 0, None, "HTTP 400")),
])
def test_a_timed_request_reads_the_stream(status: int, body: bytes, want: tuple) -> None:
    async def run() -> bench.Timed:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(base_url="http://server", transport=transport) as client:
            return await bench.timed_request(client, "/v1/chat/completions", {})

    timed = asyncio.run(run())
    times, tokens, prompt_tokens, error = want
    assert (len(timed.times), timed.tokens, timed.prompt_tokens) == (times, tokens, prompt_tokens), timed
    assert (timed.error is None) if error is None else (error in timed.error), timed
    assert timed.ok or error is not None


def test_the_openai_backend_sends_openai_fields_only() -> None:
    for api, prompt in (("completions", [1, 2, 3]), ("chat", "hello")):
        _, ours = bench.request_body(api, "m", prompt, 8, None)
        assert ours["ignore_eos"] is True and set(ours) - OPENAI_FIELDS == {"ignore_eos"}
        _, plain = bench.Target("u", "m", api, {}, ignore_eos=False).request(prompt, 8)
        assert set(plain) <= OPENAI_FIELDS, set(plain) - OPENAI_FIELDS
        _, vllm = bench.Target("u", "m", api, {}, ignore_eos=True, min_tokens=True).request(prompt, 8)
        assert set(vllm) - OPENAI_FIELDS == {"ignore_eos", "min_tokens"} and vllm["min_tokens"] == 8


def test_slowest_lists_the_requests_that_make_a_p99() -> None:
    rows = [{"ttft_ms": t, "sent_ms": 10.0 * i, "prompt_tokens": 100 + i, "tokens": 5} for i, t in
            enumerate([3.0, 9.5, None, 7.25, 1.0])]
    assert bench.slowest(rows, "ttft_ms", 2) == ("9.5 ms (sent at 10 ms, 101 prompt tokens, 5 out); "
                                                 "7.2 ms (sent at 30 ms, 103 prompt tokens, 5 out)")
    assert bench.slowest([{"ttft_ms": None}], "ttft_ms") == "none completed"


def test_argument_checks() -> None:
    for argv in (["--request-rate", "2"], ["--workload", "mixed", "--request-rate", "0"],
                 ["--workload", "mixed", "--logprobs", "2"], ["--ignore-eos"], ["--output-len", "8", "4"],
                 ["--input-len", "20", "10"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    args = bench.parse_args(["--workload", "mixed", "--request-rate", "inf", "2.5", "--output-len", "32"])
    assert args.request_rate == [math.inf, 2.5] and bench.output_range(args.output_len) == (32, 32)


@pytest.mark.parametrize(("card", "rate"), [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12),
                                           (None, 4.8e12), ("NVIDIA A100-SXM4-80GB", 4.8e12)])
def test_the_floors_bandwidth_is_the_local_cards_unless_given(monkeypatch: pytest.MonkeyPatch, card: str | None,
                                                               rate: float) -> None:
    """--hbm-bytes-per-s defaults to the local GPU's datasheet figure (an H100's is not an H200's), else an
    H200's; a value given wins."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: card is not None)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda index=0: card)
    assert bench.parse_args([]).hbm_bytes_per_s == rate
    assert bench.parse_args(["--hbm-bytes-per-s", "2e12"]).hbm_bytes_per_s == 2e12


# ---------------------------------------------------------------------------- against the tiny model
def mixed_args(out: Path) -> list[str]:
    return ["--workload", "mixed", "--requests", "3", "--output-len", "4", "8", "--json-out", str(out),
            "--seed", "5"]


@pytest.mark.slow
def test_mixed_workload_launching_ep_serve(tiny_cache: str, tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    env = {**os.environ, "EP_LAYER_CACHE": tiny_cache, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), *mixed_args(out),
                           "--launch", "--max-model-len 256", "--port", "0", "--concurrency", "2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["first_request"]["ok"] and result["first_request"]["ttft_ms"] > 0, result
    assert result["first_request"]["warm_ttft_ms"] > 0, result
    assert result["first_request"]["label"].startswith("first request after ready (ep-serve launched")
    [level] = result["levels"]
    assert (level["level"], level["completed"], level["failed"]) == ("c=2", 3, 0), (level, result["errors"])
    assert 16 <= level["prompt_tok"] <= 256 - 8 and level["step_floor_us"] > 0
    assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"] and 0 < level["tpot_p50_ms"] <= level["tpot_p99_ms"]
    assert level["itl_p99_ms"] > 0 and level["out_tok/s"] > 0
    [records] = result["per_request"]
    assert records["level"] == "c=2" and len(records["requests"]) == 3
    rows = records["requests"]
    assert all(r["error"] is None and r["sent_ms"] >= 0 and 4 <= r["tokens"] <= 8 for r in rows), rows
    assert sum(r["prompt_tokens"] for r in rows) / 3 == pytest.approx(level["prompt_tok"])
    assert max(r["ttft_ms"] for r in rows) >= level["ttft_p99_ms"] >= min(r["ttft_ms"] for r in rows)
    assert all(r["ttft_ms"] <= r["latency_ms"] for r in rows)
    slowest_ttft = max(rows, key=lambda r: r["ttft_ms"])
    assert f"c=2, the slowest TTFTs: {slowest_ttft['ttft_ms']:.1f} ms (sent at" in proc.stdout
    last = max(rows, key=lambda r: r["sent_ms"])  # the one request after the opening two
    assert records["after_opening"]["ttft_p99_ms"] == pytest.approx(last["ttft_ms"])
    assert "c=2, after its opening 2 requests (sent at once): TTFT p50 / p99" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.strip().startswith("level |"))
    assert [c.strip() for c in header.split("|")][-3:] == ["itl_p99_ms", "out_tok/s", "step_floor_us"]
    assert "# first request after ready" in proc.stdout


@pytest.mark.slow
def test_mixed_workload_as_an_openai_client(tiny_cache: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--backend openai against ep-serve as any OpenAI server (an API key, Poisson arrivals); the prompts'
    unique starts leave the server's prefix cache without a hit."""
    server = EPServe(["--max-model-len", "256", "--api-key", "secret"], tiny_cache, tmp_path / "ep-serve.log")
    try:
        server.wait_healthy()
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        metrics = scrape(server.url)
        assert "vllm:prefix_cache_hits_total" in metrics
        hits = total(metrics, "vllm:prefix_cache_hits_total")
        out = tmp_path / "openai.json"
        # Two rates: each level sends the same lengths and words, only its prompts' first words differ.
        bench.main([*mixed_args(out), "--url", server.url, "--backend", "openai", "--api-key", "secret",
                    "--request-rate", "50", "inf"])
        assert total(scrape(server.url), "vllm:prefix_cache_hits_total") == hits
    finally:
        server.stop()
    result = json.loads(out.read_text())
    assert (result["backend"], result["ignore_eos"], result["min_tokens"]) == ("openai", False, False)
    assert result["first_request"]["label"].startswith("first request of this run")
    assert [(row["level"], row["completed"], row["failed"]) for row in result["levels"]] == \
        [("r=50", 3, 0), ("r=inf", 3, 0)], result
    assert all("step_floor_us" not in row and row["ttft_p50_ms"] > 0 for row in result["levels"])
    assert "step_floor_us" not in capsys.readouterr().out


@pytest.mark.slow
def test_the_sweep_prints_ttft_and_tpot_beside_their_floors(tiny_cache: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The concurrency sweep against ep-serve: each row's TTFT and TPOT beside the decode step's and the lone
    prompt step's weight-bytes floors (a prompt activates more experts than one decode token)."""
    server = EPServe(["--max-model-len", "256"], tiny_cache, tmp_path / "ep-serve.log")
    try:
        server.wait_healthy()
        bench.main(["--url", server.url, "--concurrency", "1", "--requests", "2", "--max-tokens", "4",
                    "--prompt-len", "24"])
    finally:
        server.stop()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("conc |"))
    names = [c.strip() for c in lines[header].split("|")]
    row = dict(zip(names, (c.strip() for c in lines[header + 1].split("|")), strict=True))
    assert names[-2:] == ["step_floor_us", "prompt_floor_us"] and row["requests"] == "2"
    assert 0 < float(row["step_floor_us"]) < float(row["prompt_floor_us"])
    assert 0 < float(row["ttft_p50_ms"]) <= float(row["ttft_p99_ms"])


def test_each_client_is_warmed_by_an_untimed_get_before_its_timed_requests(monkeypatch) -> None:
    """A sweep level's and a mixed level's first request through a new client must not pay for the client's own
    first use: each client sends GET /v1/models before the requests it times."""
    seen: list[tuple[int, str, str]] = []
    body = sse({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, "[DONE]")

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((id(clients[-1]), request.method, request.url.path))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, content=body)

    real = httpx.AsyncClient
    clients: list[httpx.AsyncClient] = []

    def mocked(*args, **kwargs) -> httpx.AsyncClient:
        kwargs.pop("limits", None)
        clients.append(real(*args, transport=httpx.MockTransport(answer), **kwargs))
        return clients[-1]

    monkeypatch.setattr(bench.httpx, "AsyncClient", mocked)
    samples, _ = asyncio.run(bench.sweep_level("http://server", "completions", "m", 2, 3, 4, 1, None, "salt"))
    target = bench.Target("http://server", "m", "completions", {})
    workload = wl.mixed_workload(3, 0, (16, 32), (1, 1), rate=math.inf)
    results, _, _ = asyncio.run(bench.run_level(target, workload, ["a b", "c d", "e f"], 2))
    assert len(samples) == 3 and all(r.ok for r in results)
    assert len(clients) == 2
    for client in clients:
        mine = [(method, path) for owner, method, path in seen if owner == id(client)]
        assert mine[0] == ("GET", "/v1/models") and mine[1:] == [("POST", "/v1/completions")] * 3, mine
