"""Serving benchmark: a concurrency sweep of streaming completions against an ep-serve server.

For each concurrency level it keeps that many requests in flight (each generating exactly
--max-tokens tokens: ignore_eos; each prompt starting with a word of its own, so that the prefix cache
serves none of them) and prints TTFT and TPOT p50/p99 and output tokens/s, next to the HBM
floor of one decode step: the weight bytes one rank reads per step (its attention, dense layers, shared
experts and lm_head, plus its experts that the step's tokens activate; tensor sizes from config.json,
as the checkpoint stores them) over the HBM bandwidth, and the same floor for a step of one prompt alone:
TTFT's floor at concurrency 1 (a prompt's tokens activate many experts: 32 tokens ~160 of V3's 256 a layer).

`--api chat` sends the prompts as one user message to /v1/chat/completions. `--logprobs N` runs every
level twice, side by side: without logprobs, then with the top N of each token (completions'
`logprobs=N`, chat's `logprobs` + `top_logprobs=N`), and prints what the logprobs cost in TPOT.

`--shared-prefix N` measures prefix caching instead of the sweep: in each of --requests rounds, a request
whose prompt is a fresh N-token prefix and a short tail (cold: nothing cached), then one with the same
prefix and another tail (warm: the prefix's blocks are cached), one at a time, after a warm-up round;
it prints both TTFTs' medians, their ratio (the target is at most 0.25 for N = 1000) and the server's
prefix cache hits.

`--workload mixed` sends a mixed workload instead (benchmarks/serving_workloads.py): prompt and output
lengths log-uniform on --input-len (default 16 to 2,000 tokens) and --output-len (16 to 512, or one fixed
length), from --seed, trimmed to fit the server's max_model_len (from /v1/models); token-id prompts of
exactly those lengths, cut from real text through the server's /tokenize (their text for chat), each
starting with a word of its own. It runs each --concurrency level, or with --request-rate R each rate as
Poisson arrivals (exponential gaps from the seed; inf: all at once), and prints per level TTFT and TPOT
p50/p99, ITL p99 (the gaps between streamed chunks that carry tokens, over all requests), output tokens/s,
completed and failed requests, and the TTFT of the first request the run sends (with --launch, the first
request once /health is 200, before any other: the cold start) beside the warm TTFT of its length (the median
of a few prompts of as many words, each with a word of its own, sent right after it). Each level's slowest
requests follow, and at a fixed concurrency c the TTFT and TPOT p50/p99 of the requests after its first c (those
go at once, and their queue alone makes the level's p99 TTFT).

`--backend openai` drives any OpenAI-compatible server (vLLM, SGLang) in every mode: OpenAI's request
fields only (plus vLLM's ignore_eos and min_tokens with --ignore-eos), --api-key, no ep-serve /metrics,
and the floor only with --model-dir.

    python benchmarks/bench_serving.py                                  # launches ep-serve (tiny model, EP=2, CPU)
    python benchmarks/bench_serving.py --launch "/ckpt --enable-expert-parallel --data-parallel-size 8"
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model-dir /ckpt --concurrency 1 8 32

A DeepSeek-V3-shaped model on one GPU (V3's widths at 4 layers, random FP8 weights, no checkpoint):

    python -m serving.tiny_model /tmp/v3-4l --v3-shaped-layers 4
    python benchmarks/bench_serving.py --launch "/tmp/v3-4l --load-format dummy --max-model-len 1024"
    python benchmarks/bench_serving.py --launch "..." --api chat --logprobs 5 --concurrency 1 64
    python benchmarks/bench_serving.py --launch "/tmp/v3-4l --load-format dummy --max-model-len 2048" \
        --shared-prefix 1000 --requests 8

The mixed workload (prompts up to 2,000 tokens and outputs up to 512 need max_model_len >= 2,513), at fixed
concurrencies, then as Poisson arrivals; and against a vLLM server with the same workload:

    python benchmarks/bench_serving.py --launch "/tmp/v3-4l --load-format dummy --max-model-len 4096 --device cuda" \
        --workload mixed --concurrency 16 1 8 32 64 --requests 200 --json-out /tmp/mixed-conc.json
    python benchmarks/bench_serving.py --launch "..." --workload mixed --request-rate 1 4 16 inf --requests 200
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --backend openai --ignore-eos \
        --workload mixed --request-rate 4 16 --requests 200 [--model NAME] [--api-key KEY] [--model-dir /ckpt]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import torch
from serving_workloads import (
    OUTPUT_LEN,
    PROMPT_LEN,
    WorkloadRequest,
    fit_ranges,
    gather_limited,
    mixed_workload,
    prompt_maker,
    prompt_text,
)

from serving.loading.checkpoint import load_config
from serving.random_weights import stored_bytes

# Datasheet HBM bandwidths (bench_ll.py measures the copy rate of the card at hand); the floor's default is the
# local GPU's, else an H200's.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def local_hbm_bytes_per_s() -> float:
    """The datasheet HBM bandwidth of this machine's first GPU where it is an H100 or an H200, else an H200's."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((rate for card, rate in HBM_BYTES_PER_S.items() if card in name), HBM_BYTES_PER_S["H200"])


@dataclass
class Sample:
    ttft: float
    tpot: float
    tokens: int
    prompt_tokens: int | None = None  # the usage's


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def request_body(api: str, model: str, prompt: str | list[int], max_tokens: int, logprobs: int | None,
                 ignore_eos: bool = True, min_tokens: bool = False) -> tuple[str, dict]:
    """The endpoint and JSON body of one streamed greedy request; `logprobs`: the top N of each token.
    OpenAI's fields, plus vLLM's ignore_eos (ep-serve, vLLM and SGLang take it) unless `ignore_eos` is
    False, and vLLM's min_tokens = max_tokens with `min_tokens`."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if not ignore_eos:
        del body["ignore_eos"]
    if min_tokens:
        body["min_tokens"] = max_tokens
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if logprobs is not None:
        body["logprobs"] = logprobs
    return "/v1/completions", body


def has_logprobs(chunk: dict) -> bool:
    return any(choice.get("logprobs") for choice in chunk.get("choices", ()))


async def one_request(client: httpx.AsyncClient, endpoint: str, body: dict) -> Sample:
    start = time.perf_counter()
    first = None
    tokens, prompt_tokens = 0, None
    logprobs_seen = False
    async with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and carries_tokens(chunk):  # not a chat's opening role chunk
                first = time.perf_counter()
            logprobs_seen = logprobs_seen or has_logprobs(chunk)
            if chunk.get("usage"):
                tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"].get("prompt_tokens")
    end = time.perf_counter()
    if first is None or tokens == 0:
        raise RuntimeError("stream ended without tokens")
    wants_logprobs = "logprobs" in body
    if logprobs_seen != wants_logprobs:
        raise RuntimeError(f"asked for logprobs: {wants_logprobs}, but the stream had "
                           f"{'some' if logprobs_seen else 'none'}")
    return Sample(first - start, (end - first) / max(tokens - 1, 1), tokens, prompt_tokens)


async def warm_client(client: httpx.AsyncClient) -> None:
    """One untimed GET /v1/models through `client` before its timed requests: a client's first request pays for
    the client's own first use (its async backend loaded, a connection opened), no part of the server's TTFT: a
    fresh client's first stream read 26-41 ms against 3-7 after a GET, the same warm server (CPU, 2026-12-06)."""
    (await client.get("/v1/models")).raise_for_status()


async def sweep_level(url: str, api: str, model: str, concurrency: int, requests: int, prompt_len: int,
                      max_tokens: int, logprobs: int | None, salt: str, headers: dict[str, str] | None = None,
                      ignore_eos: bool = True, min_tokens: bool = False) -> tuple[list[Sample], float]:
    """The samples of `requests` requests, `concurrency` at a time, and the seconds they took. Each prompt
    starts with a word of its own (`salt` and its index), so that no prompt shares a first KV block with
    another, this run's or an earlier one's, and the prefix cache serves none of them."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> Sample:
        async with gate:
            unique = hashlib.sha256(f"{salt}-{i}".encode()).hexdigest()[:8]  # differs within the first few tokens
            prompt = " ".join([f"q{unique}", *(f"w{(i * 7 + j) % 97}" for j in range(prompt_len - 1))])
            return await one_request(client, *request_body(api, model, prompt, max_tokens, logprobs, ignore_eos,
                                                           min_tokens))

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0)) as client:
        await warm_client(client)
        start = time.perf_counter()
        samples = await asyncio.gather(*(limited(i) for i in range(requests)))
        return list(samples), time.perf_counter() - start


async def random_token_ids(client: httpx.AsyncClient, model: str, count: int, rng: random.Random) -> list[int]:
    """`count` token ids of random words (through the server's /tokenize, which takes at most max_model_len
    tokens at once: the words are sized from a first sample)."""
    async def tokenize(words: int) -> list[int]:
        text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))
        resp = await client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        if resp.status_code != 200:
            raise RuntimeError(f"/tokenize: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()["tokens"]

    per_word = len(await tokenize(64)) / 64
    ids: list[int] = []
    while len(ids) < count:
        ids += await tokenize(max(1, round((count - len(ids)) / per_word)) + 4)
    return ids[:count]


async def shared_prefix_ttft(url: str, model: str, prefix_len: int, rounds: int, max_tokens: int,
                             headers: dict[str, str] | None = None, ignore_eos: bool = True,
                             min_tokens: bool = False) -> list[tuple[float, float]]:
    """(cold TTFT, warm TTFT) of each round: a fresh prefix_len-token prefix and a 16-token tail, then the
    same prefix with another tail, one request at a time (token-id prompts to /v1/completions, so the
    prefix is exactly prefix_len tokens). The prefixes come from random words, new in every run."""
    rng = random.Random(os.urandom(8))
    out = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0)) as client:
        for _ in range(rounds):
            prefix = await random_token_ids(client, model, prefix_len, rng)
            samples = []
            for _tail in range(2):
                tail = await random_token_ids(client, model, 16, rng)
                endpoint, body = request_body("completions", model, "", max_tokens, None, ignore_eos, min_tokens)
                samples.append(await one_request(client, endpoint, {**body, "prompt": prefix + tail}))
            out.append((samples[0].ttft, samples[1].ttft))
    return out


def prefix_hits(url: str) -> float:
    """The server's vllm:prefix_cache_hits_total, summed over its ranks."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total{"))


def run_shared_prefix(url: str, model: str, prefix_len: int, rounds: int, max_tokens: int,
                      headers: dict[str, str] | None = None, ignore_eos: bool = True, min_tokens: bool = False,
                      read_hits: bool = True) -> None:
    """`read_hits`: read ep-serve's prefix cache hits from /metrics (not another server's)."""
    hits = prefix_hits(url) if read_hits else 0.0
    warmup, *pairs = asyncio.run(shared_prefix_ttft(url, model, prefix_len, rounds + 1, max_tokens, headers,
                                                    ignore_eos, min_tokens))
    hits = (prefix_hits(url) - hits) / (rounds + 1) if read_hits else 0.0
    print(f"warm-up round (not counted): cold TTFT {warmup[0] * 1e3:.2f} ms, warm TTFT {warmup[1] * 1e3:.2f} ms")
    for i, (cold, warm) in enumerate(pairs):
        print(f"round {i}: cold TTFT {cold * 1e3:.2f} ms, warm TTFT {warm * 1e3:.2f} ms", flush=True)
    cold = percentile([c for c, _ in pairs], 50)
    warm = percentile([w for _, w in pairs], 50)
    hits_text = f"prefix cache hits {hits:.0f} tokens a round" if read_hits else "prefix cache hits not read"
    print(f"\nshared prefix of {prefix_len} tokens, {rounds} rounds: TTFT p50 cold {cold * 1e3:.2f} ms, warm "
          f"{warm * 1e3:.2f} ms, warm/cold {warm / cold:.3f} (target <= 0.25); {hits_text}")


# ---------------------------------------------------------------------------- the mixed workload
FIRST_WORDS, FIRST_TOKENS = 15, 16  # the first request: its unique word and 15 words, 16 tokens out
WARM_REPEATS = 3  # then prompts of its length, each with a word of its own: the warm TTFT it is compared with


@dataclass
class Target:
    """Where requests go and what they carry besides OpenAI's fields: `ignore_eos` and `min_tokens` add
    vLLM's fields of those names (see request_body); `headers` carry the API key."""

    url: str
    model: str
    api: str
    headers: dict[str, str]
    ignore_eos: bool = True
    min_tokens: bool = False

    def client(self) -> httpx.AsyncClient:
        """A client without a connection limit: httpx's default pool (100) would queue a burst in the client."""
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def request(self, prompt: str | list[int], max_tokens: int) -> tuple[str, dict]:
        return request_body(self.api, self.model, prompt, max_tokens, None, self.ignore_eos, self.min_tokens)


@dataclass
class Timed:
    """One streamed request: when each chunk that carried tokens came, in seconds from when the request
    was sent, and its usage; `error` when it failed."""

    times: list[float] = field(default_factory=list)
    latency: float = 0.0  # to the stream's end
    tokens: int = 0  # completion tokens: the usage's, else the chunks that carried tokens
    prompt_tokens: int | None = None
    error: str | None = None
    sent_at: float = 0.0  # time.perf_counter() when it was sent

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.times[0]

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (tokens - 1), as vLLM's benchmark; None for a single token."""
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def carries_tokens(chunk: dict) -> bool:
    """Whether a streamed chunk carries generated tokens: a choice with text (completions' text, a chat
    delta's content or reasoning_content), or one not finished (a token whose text is incomplete UTF-8
    so far); not a chat's opening role chunk, a bare finish or the usage chunk."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if (choice.get("text") if delta is None else delta.get("content") or delta.get("reasoning_content")):
            return True
        if choice.get("finish_reason") is None and not (delta is not None and "role" in delta):
            return True
    return False


async def timed_request(client: httpx.AsyncClient, endpoint: str, body: dict) -> Timed:
    """Send one streamed request and time its chunks; any failure (an HTTP status, an error event, the
    connection) is the result's `error`, so that one request's failure does not end a level."""
    start = time.perf_counter()
    out = Timed(sent_at=start)
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {text[:300]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    out.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return out
                if carries_tokens(chunk):
                    out.times.append(now)
                if usage := chunk.get("usage"):
                    out.tokens, out.prompt_tokens = usage.get("completion_tokens") or 0, usage.get("prompt_tokens")
    except Exception as e:  # the connection, a timeout, a chunk that is not JSON
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency = time.perf_counter() - start
    if not out.times:
        out.error = "the stream ended without tokens"
    out.tokens = out.tokens or len(out.times)
    return out


def token_gaps(times: list[float]) -> list[float]:
    """The inter-token latencies of one request: the time between consecutive chunks that carried tokens."""
    return [b - a for a, b in itertools.pairwise(times)]


def percentile_or_nan(values: list[float], q: float) -> float:
    return percentile(values, q) if values else math.nan


def per_request(results: list[Timed], start: float) -> list[dict]:
    """Each request of a level as --json-out saves it (ms; `sent_ms` from the level's start): to tell which requests
    make the p99s (their prompt and output lengths, when they were sent)."""
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e3

    return [{"sent_ms": ms(r.sent_at - start), "prompt_tokens": r.prompt_tokens, "tokens": r.tokens,
             "ttft_ms": ms(r.ttft) if r.ok else None, "tpot_ms": ms(r.tpot) if r.ok else None,
             "latency_ms": ms(r.latency) if r.ok else None, "error": r.error} for r in results]


def summarize(results: list[Timed], elapsed: float) -> dict[str, float]:
    """A level's row: counts, TTFT and TPOT p50/p99 and ITL p99 (ms, ITL pooled over all requests'
    gaps) of the completed requests, their output tokens/s over the level's time, their mean prompt
    tokens (the usage's)."""
    done = [r for r in results if r.ok]
    itl = [gap * 1e3 for r in done for gap in token_gaps(r.times)]
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {"requests": len(results), "completed": len(done), "failed": len(results) - len(done),
            "prompt_tok": statistics.fmean(prompts) if prompts else math.nan, **ttft_tpot_percentiles(done),
            "itl_p99_ms": percentile_or_nan(itl, 99),
            "out_tok/s": sum(r.tokens for r in done) / elapsed if elapsed > 0 else math.nan}


def ttft_tpot_percentiles(done: list[Timed]) -> dict[str, float]:
    """TTFT and TPOT p50 / p99 (ms) of completed requests (TPOT of those with more than one token)."""
    ttft = [r.ttft * 1e3 for r in done]
    tpot = [r.tpot * 1e3 for r in done if r.tpot is not None]
    return {"ttft_p50_ms": percentile_or_nan(ttft, 50), "ttft_p99_ms": percentile_or_nan(ttft, 99),
            "tpot_p50_ms": percentile_or_nan(tpot, 50), "tpot_p99_ms": percentile_or_nan(tpot, 99)}


def after_opening(results: list[Timed], concurrency: int) -> dict[str, float]:
    """TTFT and TPOT p50 / p99 (ms) of the completed requests sent after a fixed-concurrency level's first
    `concurrency`, which all go at once: their prompts queue behind each other, so that burst alone makes the
    level's p99 TTFT; the rest arrive one at a time, as earlier ones finish."""
    later = sorted(results, key=lambda r: r.sent_at)[concurrency:]
    return ttft_tpot_percentiles([r for r in later if r.ok])


async def run_level(target: Target, workload: list[WorkloadRequest], prompts: list[str | list[int]],
                    concurrency: int | None) -> tuple[list[Timed], float, float]:
    """Send the workload: `concurrency` requests in flight at a time, or (None) each at its arrival time;
    the results, the seconds from the first send to the last stream's end, and the level's start
    (time.perf_counter())."""
    gate = asyncio.Semaphore(concurrency or len(workload))

    async def one(request: WorkloadRequest, prompt: str | list[int]) -> Timed:
        if concurrency is None and (delay := start + request.arrival_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        async with gate:
            return await timed_request(client, *target.request(prompt, request.output_len))

    async with target.client() as client:
        await warm_client(client)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, p) for r, p in zip(workload, prompts)))
        return list(results), time.perf_counter() - start, start


async def run_mixed(args: argparse.Namespace, target: Target, max_model_len: int,
                    floor_us: Callable[[int], float] | None, first_label: str) -> dict:
    """The first request, then each level of the mixed workload (a fixed concurrency or a request rate);
    prints a row per level as it ends and returns the run's results. `floor_us`: the HBM floor of a
    concurrency level (None: no floor column)."""
    run_id = os.urandom(4).hex()
    first_text = prompt_text(args.seed, f"{run_id}xfirst", 0, FIRST_WORDS)
    async with target.client() as client:
        await warm_client(client)
        first = await timed_request(client, *target.request(first_text, FIRST_TOKENS))
        warm = [await timed_request(client, *target.request(prompt_text(args.seed, f"{run_id}xwarm", i, FIRST_WORDS),
                                                            FIRST_TOKENS)) for i in range(WARM_REPEATS)]
    warm_ttft = statistics.median(w.ttft for w in warm) if first.ok and all(w.ok for w in warm) else None
    first_line = (f"{first_label}: TTFT {first.ttft * 1e3:.2f} ms, {first.tokens} tokens in "
                  f"{first.latency * 1e3:.2f} ms" if first.ok else f"{first_label}: failed: {first.error}")
    if warm_ttft is not None:
        first_line += (f"; {first.ttft / warm_ttft:.2f}x the warm TTFT of its length, {warm_ttft * 1e3:.2f} ms (median "
                       f"of {WARM_REPEATS} prompts of its length right after it)")
    print(f"# {first_line}", flush=True)
    if not first.ok and ("ignore_eos" in first.error or "min_tokens" in first.error):
        print("# (this server may not take ignore_eos / min_tokens: leave out --ignore-eos)", flush=True)
    levels = [("rate", r) for r in args.request_rate] if args.request_rate else \
        [("conc", c) for c in args.concurrency]
    rows, requests, errors = [], [], {}
    async with target.client() as tools:
        maker, reserve, how = await prompt_maker(tools, target.model, target.api == "chat", args.seed, first_text,
                                                 first.prompt_tokens if first.ok else None, max_model_len)
        print(f"# prompts: {how}", flush=True)
        asked = (tuple(args.input_len), output_range(args.output_len))
        try:
            prompt_len, output_len = fit_ranges(*asked, max_model_len, reserve)
        except ValueError as e:
            raise SystemExit(f"--input-len, --output-len: {e}") from None
        trimmed = f" (asked for {asked[0]} and {asked[1]}: trimmed to max_model_len)" if (prompt_len, output_len) \
            != asked else ""
        outputs = f"{output_len[0]}" if output_len[0] == output_len[1] else f"{output_len[0]}-{output_len[1]}"
        print(f"# prompts of {prompt_len[0]}-{prompt_len[1]} tokens, outputs of {outputs}, log-uniform{trimmed}",
              flush=True)
        for kind, value in levels:
            label = f"c={value}" if kind == "conc" else f"r={value:g}"
            n = args.requests or (max(8, 4 * value) if kind == "conc" else 64)
            workload = mixed_workload(n, args.seed, prompt_len, output_len,
                                      rate=value if kind == "rate" else math.inf)
            prompts = await gather_limited([maker.make(r, f"{run_id}x{label}") for r in workload])
            results, elapsed, start = await run_level(target, workload, prompts, value if kind == "conc" else None)
            rows.append({"level": label, **summarize(results, elapsed)})
            requests.append({"level": label, "requests": per_request(results, start)})
            if kind == "conc":
                requests[-1]["after_opening"] = after_opening(results, value)
            if floor_us is not None:
                rows[-1]["step_floor_us"] = floor_us(value) if kind == "conc" else math.nan
            for r in results:
                if not r.ok:
                    errors[r.error] = errors.get(r.error, 0) + 1
            print(" ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in rows[-1].values()), flush=True)
    return {"first_request": {"label": first_label, "ok": first.ok, "error": first.error,
                              "ttft_ms": first.ttft * 1e3 if first.ok else None, "tokens": first.tokens,
                              "warm_ttft_ms": warm_ttft * 1e3 if warm_ttft is not None else None,
                              "latency_ms": first.latency * 1e3 if first.ok else None},
            "first_line": first_line, "levels": rows, "errors": errors, "per_request": requests}


def output_range(values: list[int]) -> tuple[int, int]:
    """--output-len: one value is a fixed length, two a log-uniform range."""
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def print_mixed(result: dict, floor: bool) -> None:
    """The mixed workload's table, its first request and its errors."""
    header = ["level", "requests", "completed", "failed", "prompt_tok", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
              "tpot_p99_ms", "itl_p99_ms", "out_tok/s", *(["step_floor_us"] if floor else [])]
    print("\n" + " | ".join(f"{h:>12}" for h in header))
    for row in result["levels"]:
        print(" | ".join(f"{row[h]:12.2f}" if isinstance(row[h], float) else f"{row[h]:>12}" for h in header))
    print(result["first_line"])
    for error, count in result["errors"].items():
        print(f"failed {count}x: {error}")
    print("prompt_tok: the usage's mean prompt tokens; itl: the gaps between chunks that carried tokens, "
          "over all requests" + ("; step_floor_us: at a fixed concurrency only" if floor else ""))
    for level in result["per_request"]:
        for measure in ("ttft_ms", "tpot_ms"):
            print(f"{level['level']}, the slowest {measure[:4].upper()}s: {slowest(level['requests'], measure)}")
        if "after_opening" in level:
            later = level["after_opening"]
            print(f"{level['level']}, after its opening {level['level'][2:]} requests (sent at once): TTFT p50 / p99 "
                  f"{later['ttft_p50_ms']:.1f} / {later['ttft_p99_ms']:.1f} ms, TPOT p50 / p99 "
                  f"{later['tpot_p50_ms']:.2f} / {later['tpot_p99_ms']:.2f} ms")


def slowest(requests: list[dict], measure: str, count: int = 3) -> str:
    """The `count` completed requests with the largest `measure` (per_request's records): what makes a p99."""
    done = sorted((r for r in requests if r[measure] is not None), key=lambda r: -r[measure])[:count]
    return "; ".join(f"{r[measure]:.1f} ms (sent at {r['sent_ms']:.0f} ms, {r['prompt_tokens']} prompt tokens, "
                     f"{r['tokens']} out)" for r in done) or "none completed"


def decode_step_bytes(model_dir: Path, tokens_per_rank: int, ranks: int) -> float:
    """Weight bytes one rank reads in a decode step of `tokens_per_rank` tokens on each of `ranks` ranks."""
    return step_bytes(model_dir, tokens_per_rank * ranks, ranks)


def decode_floor_us(model_dir: Path | None, concurrency: int, ranks: int, hbm_bytes_per_s: float) -> float:
    """The HBM floor (µs) of a decode step of `concurrency` sequences spread over `ranks` ranks (NaN without the
    model's directory)."""
    per_rank = max(1, round(concurrency / ranks))
    return step_floor_us(model_dir, per_rank * ranks, ranks, hbm_bytes_per_s)


def step_floor_us(model_dir: Path | None, tokens: int, ranks: int, hbm_bytes_per_s: float) -> float:
    """step_bytes over the HBM bandwidth, in µs (NaN without the model's directory)."""
    if model_dir is None or not model_dir.is_dir():
        return math.nan
    return step_bytes(model_dir, tokens, ranks) / hbm_bytes_per_s * 1e6


def step_bytes(model_dir: Path, tokens: int, ranks: int) -> float:
    """Weight bytes one rank reads in a step of `tokens` tokens over all `ranks` ranks (decodes or a prompt's:
    a 32-token prompt activates ~160 of V3's 256 experts a layer, a decode token 8)."""
    config = load_config(model_dir)
    experts, topk = config.n_routed_experts, config.num_experts_per_tok
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    dense, expert_bytes = 0, {}
    for name, size in stored_bytes(config):
        if name.startswith(mtp_prefix) or name == "model.embed_tokens.weight":
            continue  # the MTP layer is not served; the embedding is gathered row by row
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            expert_bytes[layer] = expert_bytes.get(layer, 0) + size
        else:
            dense += size
    # Expected experts of one layer that a step's tokens (from all ranks) activate, this rank's share.
    active = experts * (1 - (1 - topk / experts) ** tokens) / ranks
    return dense + sum(total / experts * active for total in expert_bytes.values())


def launch(args_line: str, port: int, log: IO[bytes]) -> subprocess.Popen:
    """Start ep-serve with its output to `log` (a pipe nobody reads would fill and stall the server)."""
    cmd = [sys.executable, "-m", "serving.cli", *shlex.split(args_line), "--port", str(port)]
    print("# launching:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def launched_port(server: subprocess.Popen, log: IO[bytes], timeout_s: float = 600.0) -> int:
    """The port ep-serve bound (`--port 0`: one the OS picked), from its log once it listens. The log is
    read with pread: a seek would move the file offset that the server writes at."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")
        if match := re.search(r"Uvicorn running on http://\S+:(\d+)", text):
            return int(match[1])
        if server.poll() is not None:
            raise SystemExit(f"ep-serve exited with {server.returncode}: {text[-2000:]}")
        time.sleep(0.2)
    raise SystemExit(f"ep-serve logged no port within {timeout_s:.0f} s")


def wait_healthy(url: str, server: subprocess.Popen | None, log: IO[bytes], timeout_s: float = 600.0,
                 headers: dict[str, str] | None = None, models_will_do: bool = False) -> None:
    """Wait until /health answers 200 (with `models_will_do`, or /v1/models: a server without /health)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"ep-serve exited with {server.returncode}: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
            if models_will_do and httpx.get(f"{url}/v1/models", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    log.seek(0)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout_s:.0f} s; server log:\n"
                     f"{log.read().decode()[-2000:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (else one is launched)")
    parser.add_argument("--launch", default="--enable-expert-parallel --data-parallel-size 2",
                        help="ep-serve arguments for the launched server (default: built-in tiny model, EP=2)")
    parser.add_argument("--port", type=int, default=8311, help="the launched server's port (0: one the OS picks)")
    parser.add_argument("--backend", choices=("ep-serve", "openai"), default="ep-serve",
                        help="openai: any OpenAI-compatible server (vLLM, SGLang): OpenAI's request fields only "
                             "(vLLM's ignore_eos and min_tokens with --ignore-eos), no ep-serve /metrics, and the "
                             "floor only with --model-dir")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="with --backend openai: send ignore_eos and min_tokens = max_tokens (vLLM takes "
                             "both), so that every request makes all its tokens (ep-serve's backend always "
                             "sends ignore_eos)")
    parser.add_argument("--model", help="model name in the API (default: the server's first model)")
    parser.add_argument("--model-dir", type=Path, help="checkpoint directory, for the weight-bytes floor "
                        "(default: the server's model root from /v1/models; none with --backend openai)")
    parser.add_argument("--ranks", type=int, default=None, help="EP ranks of the server (for the floor)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 4 x concurrency, >= 8; "
                        "64 at a --request-rate)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="the endpoint: /v1/completions, or /v1/chat/completions with one user message")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="run each level without and then with the top-N logprobs of every token (0-20)")
    parser.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                        help="instead of the sweep: the TTFT of a request sharing an N-token prefix with the one "
                             "before it against the cold TTFT of that one, over --requests rounds (default 8)")
    mixed = parser.add_argument_group("the mixed workload (--workload mixed)")
    mixed.add_argument("--workload", choices=("sweep", "mixed"), default="sweep",
                       help="mixed: prompts and outputs of log-uniform lengths, at each --concurrency level or "
                            "--request-rate")
    mixed.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="R",
                       help="Poisson arrivals at R requests/s (inf: all at once), for each R, instead of the "
                            "--concurrency levels")
    mixed.add_argument("--input-len", type=int, nargs=2, default=list(PROMPT_LEN), metavar=("MIN", "MAX"),
                       help="prompt tokens, log-uniform (default %(default)s)")
    mixed.add_argument("--output-len", type=int, nargs="+", default=list(OUTPUT_LEN), metavar="N",
                       help="output tokens: MIN MAX, log-uniform, or one fixed N (default %(default)s)")
    mixed.add_argument("--seed", type=int, default=0, help="of the lengths, arrivals and words (default 0)")
    mixed.add_argument("--max-model-len", type=int, default=None,
                       help="the server's context length (default: max_model_len from /v1/models)")
    mixed.add_argument("--json-out", type=Path, default=None,
                       help="save the results here as JSON: each level's row, and each request's send time, "
                       "prompt and output tokens, TTFT, TPOT and latency")
    parser.add_argument("--hbm-bytes-per-s", type=float, default=None,
                        help="HBM bandwidth of the floor (default: the local GPU's datasheet figure, H100 3.35e12 or "
                             "H200 4.8e12; an H200's elsewhere)")
    parser.add_argument("--metrics-out", type=Path, default=None,
                        help="save the server's /metrics text here after the sweep")
    args = parser.parse_args(argv)
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        parser.error(f"--logprobs: expected 0..20 (OpenAI's bound), got {args.logprobs}")
    if args.shared_prefix is not None and (args.shared_prefix < 1 or args.api != "completions"):
        parser.error("--shared-prefix: expected N >= 1, with --api completions (its prompts are token ids)")
    if args.workload == "mixed" and (args.logprobs is not None or args.shared_prefix is not None):
        parser.error("--workload mixed: without --logprobs and --shared-prefix")
    if args.request_rate is not None and (args.workload != "mixed" or not all(r > 0 for r in args.request_rate)):
        parser.error("--request-rate: with --workload mixed, each rate > 0 (or inf)")
    if not 1 <= args.input_len[0] <= args.input_len[1]:
        parser.error(f"--input-len: expected 1 <= MIN <= MAX, got {args.input_len}")
    if len(args.output_len) > 2 or not 1 <= args.output_len[0] <= args.output_len[-1]:
        parser.error(f"--output-len: expected N or MIN MAX with 1 <= MIN <= MAX, got {args.output_len}")
    if args.ignore_eos and args.backend != "openai":
        parser.error("--ignore-eos: with --backend openai (ep-serve's backend always sends ignore_eos)")
    args.hbm_bytes_per_s = args.hbm_bytes_per_s or local_hbm_bytes_per_s()
    return args


def run_sweep(args: argparse.Namespace, url: str, model: str, model_dir: Path | None, ranks: int,
              target: Target) -> None:
    """The concurrency sweep: its rows as they come, then the table (without the floor column where the
    model's directory is unknown)."""
    print(f"# model {model} ({model_dir}), {ranks} rank(s), prompt {args.prompt_len} words, "
          f"{args.max_tokens} tokens per request, HBM {args.hbm_bytes_per_s / 1e12:.1f} TB/s", flush=True)
    variants = [None] if args.logprobs is None else [None, args.logprobs]
    header = ("conc", "logprobs", "requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
              "out_tok/s", "step_floor_us", "prompt_floor_us")
    columns = len(header) if model_dir is not None else len(header) - 2  # no floors without the model's directory
    run_id = os.urandom(4).hex()
    rows = []
    for concurrency in args.concurrency:
        requests = args.requests or max(8, 4 * concurrency)
        floor_us = decode_floor_us(model_dir, concurrency, ranks, args.hbm_bytes_per_s)
        for logprobs in variants:
            salt = f"{run_id}x{concurrency}x{logprobs}"
            samples, elapsed = asyncio.run(sweep_level(url, args.api, model, concurrency, requests,
                                                       args.prompt_len, args.max_tokens, logprobs, salt,
                                                       target.headers, target.ignore_eos, target.min_tokens))
            ttft = [s.ttft * 1e3 for s in samples]
            tpot = [s.tpot * 1e3 for s in samples]
            tokens = sum(s.tokens for s in samples)
            prompt_tokens = [s.prompt_tokens for s in samples if s.prompt_tokens]
            prompt_floor_us = step_floor_us(model_dir, percentile(prompt_tokens, 50), ranks, args.hbm_bytes_per_s) \
                if prompt_tokens else math.nan
            rows.append((concurrency, "-" if logprobs is None else str(logprobs), requests,
                         percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
                         tokens / elapsed, floor_us, prompt_floor_us))
            print(" ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in rows[-1][:columns]), flush=True)
    print("\n" + " | ".join(f"{h:>12}" for h in header[:columns]))
    for row in rows:
        print(" | ".join(f"{v:12.2f}" if isinstance(v, float) else f"{v:>12}" for v in row[:columns]))
    if args.logprobs is not None:
        for plain, scored in zip(rows[::2], rows[1::2]):
            print(f"logprobs={args.logprobs} at {plain[0]} concurrent: TPOT p50 {plain[5]:.2f} -> "
                  f"{scored[5]:.2f} ms ({(scored[5] / plain[5] - 1) * 100:+.1f} %), "
                  f"{plain[7]:.0f} -> {scored[7]:.0f} tokens/s")
    if model_dir is not None:
        print("step_floor_us: one rank's decode-step weight bytes over the HBM bandwidth (the TPOT floor on a GPU); "
              "prompt_floor_us: the same for a step of one prompt alone (its median tokens), TTFT's floor at "
              "concurrency 1")


def mixed_main(args: argparse.Namespace, target: Target, card: dict, model_dir: Path | None, ranks: int,
               first_label: str) -> None:
    """The mixed workload: its levels, the table, and the JSON file when asked for."""
    max_model_len = args.max_model_len or card.get("max_model_len")
    if not max_model_len:
        raise SystemExit(f"/v1/models does not say the model's max_model_len: pass --max-model-len ({card})")

    def floor_us(concurrency: int) -> float:
        return decode_floor_us(model_dir, concurrency, ranks, args.hbm_bytes_per_s)

    print(f"# mixed workload against {target.model} ({args.backend}, {target.url}, {args.api}), max_model_len "
          f"{max_model_len}, seed {args.seed}; model dir {model_dir}, {ranks} rank(s)", flush=True)
    result = asyncio.run(run_mixed(args, target, max_model_len, None if model_dir is None else floor_us, first_label))
    print_mixed(result, model_dir is not None)
    if args.json_out is not None:
        meta = {"backend": args.backend, "url": target.url, "model": target.model, "api": args.api, "seed": args.seed,
                "max_model_len": max_model_len, "input_len": args.input_len, "output_len": args.output_len,
                "ignore_eos": target.ignore_eos, "min_tokens": target.min_tokens}
        levels = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
                  for row in result["levels"]]  # strict JSON has no NaN
        args.json_out.write_text(json.dumps({**meta, **result, "levels": levels}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    openai = args.backend == "openai"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the server's lifetime, closed in finally)
    url = args.url
    launched_at = time.perf_counter()
    if url is None:
        server = launch(args.launch, args.port, log)
    try:
        if url is None:
            url = f"http://127.0.0.1:{args.port or launched_port(server, log)}"
        wait_healthy(url, server, log, headers=headers, models_will_do=openai)
        ready_s = time.perf_counter() - launched_at
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
        model = args.model or models[0]["id"]
        target = Target(url, model, args.api, headers, ignore_eos=not openai or args.ignore_eos,
                        min_tokens=args.ignore_eos)
        if args.shared_prefix is not None:
            run_shared_prefix(url, model, args.shared_prefix, args.requests or 8, args.max_tokens, headers,
                              target.ignore_eos, target.min_tokens, read_hits=not openai)
            return
        model_dir = args.model_dir or (None if openai else Path(models[0]["root"]))
        ranks = args.ranks or (int(shlex.split(args.launch)[shlex.split(args.launch).index("--data-parallel-size") + 1])
                               if server is not None and "--data-parallel-size" in args.launch else 1)
        if args.workload == "mixed":
            card = next((m for m in models if m["id"] == model), models[0])
            first_label = (f"first request after ready (ep-serve launched, /health 200 after {ready_s:.1f} s; "
                           "no request before it but /v1/models)" if server is not None else
                           "first request of this run (the server was already running)")
            mixed_main(args, target, card, model_dir, ranks, first_label)
        else:
            run_sweep(args, url, model, model_dir, ranks, target)
        if args.metrics_out is not None:
            args.metrics_out.write_text(httpx.get(f"{url}/metrics", headers=headers, timeout=30).text)
    finally:
        if server is not None:
            stop_server(server)
        log.close()


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the launched server's process group, SIGKILL after 30 s; nothing to do where it has already
    exited (a server that failed to start: its error, not this one, is what the run reports)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
