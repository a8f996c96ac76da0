"""Load test for ep-serve's /v1/completions: a bounded burst of mixed requests (streaming or not, n > 1,
several prompts per request, random lengths, greedy and seeded sampling, stop strings), every answer
checked, whatever the model says.

    python benchmarks/load.py --url http://127.0.0.1:8000 --requests 300 [--seed 0] [--api-key KEY]

The checks do not depend on the model's text:
- reference: each request is first sent alone, one at a time and not streamed; greedy and seeded
  sampling are deterministic per request, so in the burst every choice must be exactly that text,
  finish_reason and stop_reason (tokens of another request mixed in, or a KV block read by the wrong
  sequence, change the text). This needs a model whose logits do not depend on the batch (the test
  suite's fake model; real models on GPU are close, not exact): --no-reference skips it.
- form: a streamed answer is `data:` events of one id, one finished chunk per choice and last for
  it, the usage chunk when asked for, then exactly one `data: [DONE]`; a plain one has every choice
  index once, a finish_reason each and usage that adds up. Ids are unique over the burst.
- the server's own count: /metrics' vllm:request_success_total grows by exactly the number of
  sequences sent (none lost, none counted twice), none of them aborted.

A 503 (the server's queue is full) is retried after its Retry-After; the report counts them.
Prints a JSON report; exit status 1 when a check fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from serving_workloads import WORDS  # this script's folder is on sys.path

RETRY_LIMIT_S = 30.0  # a request still refused (503) after this long counts as failed


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Answer:
    """What one request got back (after any 503 retries), and what was wrong with its form."""

    status: int = 0
    id: str | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    completion_tokens: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    retries: int = 0
    retry_after_s: float | None = None  # a 503's Retry-After
    problems: list[str] = field(default_factory=list)


def _tag(i: int) -> str:
    """A word of letters unique to i, so that every prompt differs."""
    out = ""
    while True:
        out += "abcdefghijklmnopqrstuvwxyz"[i % 26]
        i //= 26
        if not i:
            return f"q{out}"


def make_requests(count: int, seed: int, max_prompt_words: int = 40, max_tokens: int = 32,
                  model: str | None = None) -> list[tuple[dict[str, Any], bool]]:
    """`count` (body, stream) pairs, random but fixed by `seed`; all prompts are different."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        def prompt(j: int, i: int = i) -> str:
            return " ".join([_tag(2 * i + j), *rng.choices(WORDS, k=rng.randint(0, max_prompt_words - 1))])

        body: dict[str, Any] = {"prompt": prompt(0) if rng.random() < 0.85 else [prompt(0), prompt(1)],
                                "max_tokens": rng.randint(1, max_tokens), "n": 2 if rng.random() < 0.2 else 1,
                                "ignore_eos": rng.random() < 0.5}
        if model is not None:
            body["model"] = model
        if rng.random() < 0.7:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        if rng.random() < 0.1:
            body["stop"] = [rng.choice("etaoinsh")]
        stream = rng.random() < 0.5
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        out.append((body, stream))
    return out


def num_choices(body: dict[str, Any]) -> int:
    prompts = body["prompt"]
    return body.get("n", 1) * (len(prompts) if isinstance(prompts, list) else 1)


async def send(client: httpx.AsyncClient, body: dict[str, Any], stream: bool) -> Answer:
    """One request, retried after a 503's Retry-After for up to RETRY_LIMIT_S."""
    answer = Answer()
    start = time.monotonic()
    while True:
        if stream:
            await _stream(client, body, answer, time.monotonic())
        else:
            await _plain(client, body, answer)
        if answer.retry_after_s is None or time.monotonic() - start > RETRY_LIMIT_S:
            break
        await asyncio.sleep(answer.retry_after_s)
        answer = Answer(retries=answer.retries + 1)
    answer.latency_s = time.monotonic() - start
    if answer.status == 200:
        _check_choices(body, answer)
    return answer


async def _plain(client: httpx.AsyncClient, body: dict[str, Any], answer: Answer) -> None:
    resp = await client.post("/v1/completions", json={**body, "stream": False})
    answer.status = resp.status_code
    if resp.status_code != 200:
        _note_error(resp.status_code, resp.headers, resp.content, answer)
        return
    data = resp.json()
    answer.id = data.get("id")
    for c in data.get("choices", []):
        if c["index"] in answer.choices:
            answer.problems.append(f"choice {c['index']} twice")
        answer.choices[c["index"]] = Choice(c["text"], c["finish_reason"], c.get("stop_reason"))
    usage = data.get("usage") or {}
    answer.completion_tokens = usage.get("completion_tokens")
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0):
        answer.problems.append(f"usage does not add up: {usage}")
    if data.get("object") != "text_completion":
        answer.problems.append(f"object {data.get('object')!r}")


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], answer: Answer, start: float) -> None:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        answer.status = resp.status_code
        if resp.status_code != 200:
            _note_error(resp.status_code, resp.headers, await resp.aread(), answer)
            return
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            answer.problems.append(f"content-type {resp.headers.get('content-type')!r}")
        events: list[Any] = []
        async for line in resp.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                answer.problems.append(f"not an SSE data line: {line[:80]!r}")
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if answer.ttft_s is None and isinstance(events[-1], dict) and events[-1].get("choices"):
                answer.ttft_s = time.monotonic() - start
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        answer.problems.append(f"expected one final [DONE], got {events.count('[DONE]')} (last: {events[-1:]})")
    chunks = [e for e in events if isinstance(e, dict)]
    if any("error" in c for c in chunks):
        answer.problems.append(f"error event: {next(c for c in chunks if 'error' in c)}")
        return
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1:
        answer.problems.append(f"chunks carry {len(ids)} ids")
    answer.id = next(iter(ids), None)
    if (body.get("stream_options") or {}).get("include_usage"):
        if not chunks or chunks[-1].get("choices") != [] or not chunks[-1].get("usage"):
            answer.problems.append("no usage chunk at the end")
        else:
            answer.completion_tokens = chunks[-1]["usage"]["completion_tokens"]
            chunks = chunks[:-1]
    for c in chunks:
        if c.get("object") != "text_completion" or "usage" in c:
            answer.problems.append(f"bad chunk: {c}")
        for choice in c.get("choices", []):
            got = answer.choices.setdefault(choice["index"], Choice())
            if got.finish_reason is not None:
                answer.problems.append(f"choice {choice['index']}: a chunk after its finished one")
            got.text += choice["text"]
            got.finish_reason, got.stop_reason = choice["finish_reason"], choice.get("stop_reason")


def _note_error(status: int, headers: httpx.Headers, content: bytes, answer: Answer) -> None:
    try:
        error = json.loads(content)["error"]
        assert {"message", "type", "code"} <= set(error) and error["code"] == status
    except Exception:
        answer.problems.append(f"HTTP {status} without the error envelope: {content[:200]!r}")
    if status == 503 and "retry-after" in headers:
        answer.retry_after_s = min(float(headers["retry-after"]), 5.0)


def _check_choices(body: dict[str, Any], answer: Answer) -> None:
    want = num_choices(body)
    if sorted(answer.choices) != list(range(want)):
        answer.problems.append(f"choice indices {sorted(answer.choices)}, expected 0..{want - 1}")
    unfinished = [i for i, c in answer.choices.items() if c.finish_reason is None]
    if unfinished:
        answer.problems.append(f"choices {unfinished} never finished")


async def run_requests(url: str, requests: list[tuple[dict[str, Any], bool]], concurrency: int,
                       api_key: str | None = None, timeout_s: float = 120.0) -> list[Answer]:
    """Send all requests, at most `concurrency` at once; their answers, in order."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any], stream: bool) -> Answer:
        async with gate:
            return await send(client, body, stream)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as client:
        return await asyncio.gather(*(one(b, s) for b, s in requests))


async def references(url: str, requests: list[tuple[dict[str, Any], bool]], api_key: str | None = None
                     ) -> list[Answer]:
    """Each request alone, one at a time, not streamed: what the burst must reproduce."""
    plain = [({k: v for k, v in body.items() if k != "stream_options"}, False) for body, _ in requests]
    return await run_requests(url, plain, 1, api_key)


def success_counts(url: str, api_key: str | None = None) -> dict[str, float] | None:
    """vllm:request_success_total by finished_reason, summed over ranks; None if /metrics is not there."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    resp = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    if resp.status_code != 200:
        return None
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                reason = s.labels["finished_reason"]
                counts[reason] = counts.get(reason, 0.0) + s.value
    return counts


def check(requests: list[tuple[dict[str, Any], bool]], answers: list[Answer],
          refs: list[Answer] | None) -> list[str]:
    """Every problem found, as 'request i: ...' lines (none: every request got exactly its answer)."""
    problems = []
    seen: dict[str, int] = {}
    for i, ((_, stream), got) in enumerate(zip(requests, answers)):
        where = f"request {i} ({'stream' if stream else 'plain'})"
        problems += [f"{where}: {p}" for p in got.problems]
        if got.status != 200:
            problems.append(f"{where}: HTTP {got.status}")
            continue
        if got.id in seen:
            problems.append(f"{where}: id {got.id} also answered request {seen[got.id]}")
        seen[got.id or ""] = i
        if refs is None:
            continue
        ref = refs[i]
        if ref.status != 200 or ref.problems:
            problems.append(f"{where}: its reference failed: HTTP {ref.status} {ref.problems}")
            continue
        for index, want in ref.choices.items():
            have = got.choices.get(index)
            if have != want:
                problems.append(f"{where} choice {index}: got {have}, alone it gave {want}")
        if got.completion_tokens is not None and got.completion_tokens != ref.completion_tokens:
            problems.append(f"{where}: {got.completion_tokens} completion tokens, alone {ref.completion_tokens}")
    return problems


@dataclass
class Report:
    requests: int
    sequences: int
    streamed: int
    ok: int
    retried_503: int
    problems: list[str]
    burst_s: float
    reference_s: float | None
    output_tokens: int | None
    output_tokens_per_s: float | None
    latency_s: dict[str, float]
    ttft_s: dict[str, float]
    server_success_delta: dict[str, float] | None


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {f"p{p}": round(values[min(len(values) - 1, int(p / 100 * len(values)))], 4) for p in (50, 90, 99)}


def run_load(url: str, count: int = 300, seed: int = 0, concurrency: int | None = None,
             api_key: str | None = None, reference: bool = True, max_prompt_words: int = 40,
             max_tokens: int = 32, model: str | None = None) -> Report:
    """References (unless reference=False), then the burst, then the checks."""
    requests = make_requests(count, seed, max_prompt_words, max_tokens, model)
    refs, reference_s = None, None
    if reference:
        start = time.monotonic()
        refs = asyncio.run(references(url, requests, api_key))
        reference_s = time.monotonic() - start
    before = success_counts(url, api_key)
    start = time.monotonic()
    answers = asyncio.run(run_requests(url, requests, concurrency or count, api_key))
    burst_s = time.monotonic() - start
    after = success_counts(url, api_key)
    problems = check(requests, answers, refs)
    sequences = sum(num_choices(body) for body, _ in requests)
    delta = None
    if before is not None and after is not None:
        delta = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in sorted(set(before) | set(after))}
        if sum(delta.values()) != sequences or delta.get("abort", 0.0):
            problems.append(f"the server counted {delta} finished sequences, {sequences} were sent")
    # Streams without include_usage do not say how many tokens they got: their references do.
    tokens = [a.completion_tokens for a in refs or answers]
    output_tokens = sum(t for t in tokens if t is not None) if all(t is not None for t in tokens) else None
    return Report(
        requests=count, sequences=sequences, streamed=sum(s for _, s in requests),
        ok=sum(a.status == 200 and not a.problems for a in answers), retried_503=sum(a.retries for a in answers),
        problems=problems, burst_s=round(burst_s, 3),
        reference_s=None if reference_s is None else round(reference_s, 3), output_tokens=output_tokens,
        output_tokens_per_s=None if output_tokens is None else round(output_tokens / burst_s, 1),
        latency_s=_percentiles([a.latency_s for a in answers]),
        ttft_s=_percentiles([a.ttft_s for a in answers if a.ttft_s is not None]), server_success_delta=delta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="ep-serve's base URL")
    p.add_argument("--requests", type=int, default=300, help="requests in the burst")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: all at once)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--max-prompt-words", type=int, default=40, help="longest prompt, in words")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request")
    p.add_argument("--model", default=None, help="the model field of the requests (default: none)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the one-at-a-time reference run (for models whose output depends on the batch)")
    args = p.parse_args(argv)
    report = run_load(args.url, args.requests, args.seed, args.concurrency, args.api_key, not args.no_reference,
                      args.max_prompt_words, args.max_tokens, args.model)
    print(json.dumps(asdict(report), indent=2))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
