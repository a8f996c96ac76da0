"""Serving benchmark: a concurrency sweep of streaming completions against an ep-serve server.

For each concurrency level it keeps that many requests in flight (each generating exactly
--max-tokens tokens: ignore_eos; each prompt starting with a word of its own, so that the prefix cache
serves none of them) and prints TTFT and TPOT p50/p99 and output tokens/s, next to the HBM
floor of one decode step: the weight bytes one rank reads per step (its attention, dense layers, shared
experts and lm_head, plus its experts that the step's tokens activate; tensor sizes from config.json,
as the checkpoint stores them) over the HBM bandwidth.

`--api chat` sends the prompts as one user message to /v1/chat/completions. `--logprobs N` runs every
level twice, side by side: without logprobs, then with the top N of each token (completions'
`logprobs=N`, chat's `logprobs` + `top_logprobs=N`), and prints what the logprobs cost in TPOT.

`--shared-prefix N` measures prefix caching instead of the sweep: in each of --requests rounds, a request
whose prompt is a fresh N-token prefix and a short tail (cold: nothing cached), then one with the same
prefix and another tail (warm: the prefix's blocks are cached), one at a time, after a warm-up round;
it prints both TTFTs' medians, their ratio (the target is at most 0.25 for N = 1000) and the server's
prefix cache hits.

    python benchmarks/bench_serving.py                                  # launches ep-serve (tiny model, EP=2, CPU)
    python benchmarks/bench_serving.py --launch "/ckpt --enable-expert-parallel --data-parallel-size 8"
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model-dir /ckpt --concurrency 1 8 32

A DeepSeek-V3-shaped model on one GPU (V3's widths at 4 layers, random FP8 weights, no checkpoint):

    python -m serving.tiny_model /tmp/v3-4l --v3-shaped-layers 4
    python benchmarks/bench_serving.py --launch "/tmp/v3-4l --load-format dummy --max-model-len 1024"
    python benchmarks/bench_serving.py --launch "..." --api chat --logprobs 5 --concurrency 1 64
    python benchmarks/bench_serving.py --launch "/tmp/v3-4l --load-format dummy --max-model-len 2048" \
        --shared-prefix 1000 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from serving.loading.checkpoint import load_config
from serving.random_weights import stored_bytes

H200_HBM_BYTES_PER_S = 4.8e12  # datasheet; bench_ll.py measures the copy rate of the card at hand


@dataclass
class Sample:
    ttft: float
    tpot: float
    tokens: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def request_body(api: str, model: str, prompt: str, max_tokens: int, logprobs: int | None) -> tuple[str, dict]:
    """The endpoint and JSON body of one streamed greedy request; `logprobs`: the top N of each token."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
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
    tokens = 0
    logprobs_seen = False
    async with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            logprobs_seen = logprobs_seen or has_logprobs(chunk)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or tokens == 0:
        raise RuntimeError("stream ended without tokens")
    wants_logprobs = "logprobs" in body
    if logprobs_seen != wants_logprobs:
        raise RuntimeError(f"asked for logprobs: {wants_logprobs}, but the stream had "
                           f"{'some' if logprobs_seen else 'none'}")
    return Sample(first - start, (end - first) / max(tokens - 1, 1), tokens)


async def sweep_level(url: str, api: str, model: str, concurrency: int, requests: int, prompt_len: int,
                      max_tokens: int, logprobs: int | None, salt: str) -> tuple[list[Sample], float]:
    """The samples of `requests` requests, `concurrency` at a time, and the seconds they took. Each prompt
    starts with a word of its own (`salt` and its index), so that no prompt shares a first KV block with
    another, this run's or an earlier one's, and the prefix cache serves none of them."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> Sample:
        async with gate:
            unique = hashlib.sha256(f"{salt}-{i}".encode()).hexdigest()[:8]  # differs within the first few tokens
            prompt = " ".join([f"q{unique}", *(f"w{(i * 7 + j) % 97}" for j in range(prompt_len - 1))])
            return await one_request(client, *request_body(api, model, prompt, max_tokens, logprobs))

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
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


async def shared_prefix_ttft(url: str, model: str, prefix_len: int, rounds: int,
                             max_tokens: int) -> list[tuple[float, float]]:
    """(cold TTFT, warm TTFT) of each round: a fresh prefix_len-token prefix and a 16-token tail, then the
    same prefix with another tail, one request at a time (token-id prompts to /v1/completions, so the
    prefix is exactly prefix_len tokens). The prefixes come from random words, new in every run."""
    rng = random.Random(os.urandom(8))
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        for _ in range(rounds):
            prefix = await random_token_ids(client, model, prefix_len, rng)
            samples = []
            for _tail in range(2):
                tail = await random_token_ids(client, model, 16, rng)
                endpoint, body = request_body("completions", model, "", max_tokens, None)
                samples.append(await one_request(client, endpoint, {**body, "prompt": prefix + tail}))
            out.append((samples[0].ttft, samples[1].ttft))
    return out


def prefix_hits(url: str) -> float:
    """The server's vllm:prefix_cache_hits_total, summed over its ranks."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total{"))


def run_shared_prefix(url: str, model: str, prefix_len: int, rounds: int, max_tokens: int) -> None:
    hits = prefix_hits(url)
    warmup, *pairs = asyncio.run(shared_prefix_ttft(url, model, prefix_len, rounds + 1, max_tokens))
    hits = (prefix_hits(url) - hits) / (rounds + 1)
    print(f"warm-up round (not counted): cold TTFT {warmup[0] * 1e3:.2f} ms, warm TTFT {warmup[1] * 1e3:.2f} ms")
    for i, (cold, warm) in enumerate(pairs):
        print(f"round {i}: cold TTFT {cold * 1e3:.2f} ms, warm TTFT {warm * 1e3:.2f} ms", flush=True)
    cold = percentile([c for c, _ in pairs], 50)
    warm = percentile([w for _, w in pairs], 50)
    print(f"\nshared prefix of {prefix_len} tokens, {rounds} rounds: TTFT p50 cold {cold * 1e3:.2f} ms, warm "
          f"{warm * 1e3:.2f} ms, warm/cold {warm / cold:.3f} (target <= 0.25); prefix cache hits {hits:.0f} "
          f"tokens a round")


def decode_step_bytes(model_dir: Path, tokens_per_rank: int, ranks: int) -> float:
    """Weight bytes one rank reads in a decode step of `tokens_per_rank` tokens on each of `ranks` ranks."""
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
    active = experts * (1 - (1 - topk / experts) ** (tokens_per_rank * ranks)) / ranks
    return dense + sum(total / experts * active for total in expert_bytes.values())


def launch(args_line: str, port: int, log: IO[bytes]) -> subprocess.Popen:
    """Start ep-serve with its output to `log` (a pipe nobody reads would fill and stall the server)."""
    cmd = [sys.executable, "-m", "serving.cli", *shlex.split(args_line), "--port", str(port)]
    print("# launching:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, server: subprocess.Popen | None, log: IO[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"ep-serve exited with {server.returncode}: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    log.seek(0)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout_s:.0f} s; server log:\n"
                     f"{log.read().decode()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (else one is launched)")
    parser.add_argument("--launch", default="--enable-expert-parallel --data-parallel-size 2",
                        help="ep-serve arguments for the launched server (default: built-in tiny model, EP=2)")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--model", help="model name in the API (default: the server's first model)")
    parser.add_argument("--model-dir", type=Path, help="checkpoint directory, for the weight-bytes floor "
                        "(default: the server's model root from /v1/models)")
    parser.add_argument("--ranks", type=int, default=None, help="EP ranks of the server (for the floor)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 4 x concurrency, >= 8)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="the endpoint: /v1/completions, or /v1/chat/completions with one user message")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="run each level without and then with the top-N logprobs of every token (0-20)")
    parser.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                        help="instead of the sweep: the TTFT of a request sharing an N-token prefix with the one "
                             "before it against the cold TTFT of that one, over --requests rounds (default 8)")
    parser.add_argument("--hbm-bytes-per-s", type=float, default=H200_HBM_BYTES_PER_S)
    parser.add_argument("--metrics-out", type=Path, default=None,
                        help="save the server's /metrics text here after the sweep")
    args = parser.parse_args()
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        parser.error(f"--logprobs: expected 0..20 (OpenAI's bound), got {args.logprobs}")
    if args.shared_prefix is not None and (args.shared_prefix < 1 or args.api != "completions"):
        parser.error("--shared-prefix: expected N >= 1, with --api completions (its prompts are token ids)")

    server = None
    log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the server's lifetime, closed in finally)
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        server = launch(args.launch, args.port, log)
    try:
        wait_healthy(url, server, log)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        model = args.model or models[0]["id"]
        if args.shared_prefix is not None:
            run_shared_prefix(url, model, args.shared_prefix, args.requests or 8, args.max_tokens)
            return
        model_dir = args.model_dir or Path(models[0]["root"])
        ranks = args.ranks or (int(shlex.split(args.launch)[shlex.split(args.launch).index("--data-parallel-size") + 1])
                               if server is not None and "--data-parallel-size" in args.launch else 1)
        print(f"# model {model} ({model_dir}), {ranks} rank(s), prompt {args.prompt_len} words, "
              f"{args.max_tokens} tokens per request, HBM {args.hbm_bytes_per_s / 1e12:.1f} TB/s", flush=True)
        variants = [None] if args.logprobs is None else [None, args.logprobs]
        run_id = os.urandom(4).hex()
        rows = []
        for concurrency in args.concurrency:
            requests = args.requests or max(8, 4 * concurrency)
            per_rank = max(1, round(concurrency / ranks))
            floor_us = decode_step_bytes(model_dir, per_rank, ranks) / args.hbm_bytes_per_s * 1e6 \
                if model_dir.is_dir() else float("nan")
            for logprobs in variants:
                salt = f"{run_id}x{concurrency}x{logprobs}"
                samples, elapsed = asyncio.run(sweep_level(url, args.api, model, concurrency, requests,
                                                           args.prompt_len, args.max_tokens, logprobs, salt))
                ttft = [s.ttft * 1e3 for s in samples]
                tpot = [s.tpot * 1e3 for s in samples]
                tokens = sum(s.tokens for s in samples)
                rows.append((concurrency, "-" if logprobs is None else str(logprobs), requests,
                             percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
                             tokens / elapsed, floor_us))
                print(" ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
        header = ("conc", "logprobs", "requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                  "out_tok/s", "step_floor_us")
        print("\n" + " | ".join(f"{h:>12}" for h in header))
        for row in rows:
            print(" | ".join(f"{v:12.2f}" if isinstance(v, float) else f"{v:>12}" for v in row))
        if args.logprobs is not None:
            for plain, scored in zip(rows[::2], rows[1::2]):
                print(f"logprobs={args.logprobs} at {plain[0]} concurrent: TPOT p50 {plain[5]:.2f} -> "
                      f"{scored[5]:.2f} ms ({(scored[5] / plain[5] - 1) * 100:+.1f} %), "
                      f"{plain[7]:.0f} -> {scored[7]:.0f} tokens/s")
        print("step_floor_us: one rank's decode-step weight bytes over the HBM bandwidth (the TPOT floor on a GPU)")
        if args.metrics_out is not None:
            args.metrics_out.write_text(httpx.get(f"{url}/metrics", timeout=30).text)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()


if __name__ == "__main__":
    main()
