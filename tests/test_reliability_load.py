"""Reliability under load (docs/reliability.md): real uvicorn servers on 127.0.0.1 in front of engine
rank processes with the fake model (tests/serving_fakes.py, whose output does not depend on the batch).

- Load: a burst of 300 mixed requests (benchmarks/load.py) where every request must get exactly what it
  gets when sent alone, streamed or not; none lost, none duplicated, none mixed with another's tokens.
- Backpressure: past max_num_seqs running and max_waiting_seqs waiting, new requests get a 503 with
  Retry-After at once; the server serves again when the burst is over.
- Cancellation: a client that hangs up (streaming or not) aborts its request, its KV blocks are freed
  (vllm:kv_cache_usage_perc), and the requests around it are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from test_serving_api import NAME, check_envelope, expected, fake_config, http_server, scrape, sse_events, total

from serving.api.server import ServerState, make_server_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import load

BURST = 300


@contextlib.contextmanager
def served(max_waiting_seqs: int | None = None, **config) -> Iterator[tuple[str, ServerState]]:
    state = make_server_state(fake_config(**config), start_timeout_s=60, max_waiting_seqs=max_waiting_seqs)
    try:
        with http_server(state) as url:
            yield url, state
    finally:
        state.coordinator.shutdown()


def metric(url: str, name: str, **labels) -> float:
    with httpx.Client(base_url=url, timeout=30) as c:
        return total(scrape(c), name, model_name=NAME, **labels)


def idle(url: str, state: ServerState) -> None:
    """Nothing running, waiting or holding KV blocks, on the server's side and the engine's."""
    assert state.coordinator.load() == [0] * len(state.coordinator.load())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(url, name) == 0, name


# ---------------------------------------------------------------------------- load
@pytest.mark.slow
def test_burst_of_mixed_requests_each_gets_exactly_its_own_answer(seed):
    with served(model="fake", max_waiting_seqs=1000) as (url, state):
        report = load.run_load(url, BURST, seed=seed % (1 << 32))
        print(f"load: {report}")
        assert not report.problems, f"seed={seed}: {len(report.problems)} problems:\n" + "\n".join(report.problems[:20])
        assert report.ok == BURST and report.retried_503 == 0
        assert 0 < report.streamed < BURST and report.sequences > BURST  # both kinds; some n > 1 or prompt lists
        assert sum(report.server_success_delta.values()) == report.sequences
        idle(url, state)


def test_load_checks_see_swapped_and_malformed_answers():
    """The burst's checks are not vacuous: two requests that got each other's text, a stream without
    [DONE] and a repeated id are all reported."""
    requests = [({"prompt": "a", "max_tokens": 2}, False), ({"prompt": "b", "max_tokens": 2}, True)]
    refs = [load.Answer(200, f"r{i}", {0: load.Choice(t, "length")}, 2) for i, t in enumerate(("xy", "zw"))]
    swapped = [load.Answer(200, "a", {0: load.Choice("zw", "length")}, 2),
               load.Answer(200, "b", {0: load.Choice("xy", "length")}, 2)]
    assert len(load.check(requests, swapped, refs)) == 2
    assert load.check(requests, refs, refs) == []
    twice = [refs[0], load.Answer(200, "r0", {0: load.Choice("zw", "length")}, 2, problems=["no [DONE]"])]
    assert len(load.check(requests, twice, refs)) == 2


# ---------------------------------------------------------------------------- backpressure
@pytest.mark.slow
def test_full_queue_gets_503_with_retry_after_at_once_then_recovers():
    running, waiting, burst, max_tokens = 2, 1, 20, 100  # 10 ms a step: an admitted request takes >= 1 s
    with served(model="fake-slow", max_num_seqs=running, max_waiting_seqs=waiting) as (url, state):
        rejected_before = metric(url, "ep_layer:requests_rejected_total")
        prompts = [f"burst {'abcdefghijklmnopqrst'[i]} the cat" for i in range(burst)]

        async def one(c: httpx.AsyncClient, prompt: str) -> tuple[httpx.Response, float]:
            start = time.monotonic()
            resp = await c.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True})
            return resp, time.monotonic() - start

        async def run_all() -> list[tuple[httpx.Response, float]]:
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=burst)) as c:
                return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 60)

        results = asyncio.run(run_all())
        ok = [(p, r, s) for p, (r, s) in zip(prompts, results) if r.status_code == 200]
        busy = [(r, s) for r, s in results if r.status_code == 503]
        assert len(ok) == running + waiting and len(busy) == burst - len(ok), [r.status_code for r, _ in results]
        for prompt, resp, took in ok:
            assert resp.json()["choices"][0]["text"] == expected(prompt, max_tokens)
            assert took >= 0.9
        for resp, took in busy:
            err = check_envelope(resp, 503)
            assert err["type"] == "ServiceUnavailableError" and "busy" in err["message"]
            assert resp.headers["retry-after"] == "1"
            assert took < 0.5, f"a refusal took {took:.2f} s: it waited instead of answering at once"
        assert metric(url, "ep_layer:requests_rejected_total") - rejected_before == len(busy)
        idle(url, state)
        # Over: served again. A request larger than the whole queue can never fit: 400, not 503.
        with httpx.Client(base_url=url, timeout=30) as c:
            resp = c.post("/v1/completions", json={"prompt": "after", "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected("after", 5)
            err = check_envelope(c.post("/v1/completions", json={"prompt": "ab", "n": running + waiting + 1}), 400)
            assert err["param"] == "n"


# ---------------------------------------------------------------------------- cancellation
@pytest.mark.slow
def test_disconnected_clients_free_their_kv_blocks_and_others_are_untouched():
    with served(model="fake-slow") as (url, state), httpx.Client(base_url=url, timeout=30) as c:
        aborts = metric(url, "vllm:request_success_total", finished_reason="abort")
        body = {"model": NAME, "temperature": 0, "ignore_eos": True}

        # A streaming client alone: its blocks show in the KV usage, and go when it hangs up.
        with c.stream("POST", "/v1/completions", json={**body, "prompt": "hang up", "max_tokens": 200,
                                                       "stream": True}) as resp:
            chunks = 0
            for line in resp.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 20:  # (leaving the loop closes the stream: look before)
                    assert metric(url, "vllm:kv_cache_usage_perc") > 0
                    assert metric(url, "vllm:num_requests_running") == 1
                    break
        wait_for(lambda: metric(url, "vllm:request_success_total", finished_reason="abort") == aborts + 1
                 and metric(url, "vllm:kv_cache_usage_perc") == 0, "the stream's blocks were not freed")
        idle(url, state)

        # Among others: a stream and a non-streaming client hang up mid-way; the rest get their exact text.
        keep = [("keep one", 60, False), ("keep two", 80, True), ("keep three", 40, False)]
        texts: dict[str, str] = {}

        def run(prompt: str, max_tokens: int, stream: bool) -> None:
            with httpx.Client(base_url=url, timeout=60) as own:
                if not stream:
                    resp = own.post("/v1/completions", json={**body, "prompt": prompt, "max_tokens": max_tokens})
                    texts[prompt] = resp.json()["choices"][0]["text"]
                    return
                with own.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "max_tokens": max_tokens,
                                                                 "stream": True}) as resp:
                    events = sse_events(resp.iter_lines())
                assert events[-1] == "[DONE]"
                texts[prompt] = "".join(e["choices"][0]["text"] for e in events[:-1])

        threads = [threading.Thread(target=run, args=k) for k in keep]
        for t in threads:
            t.start()
        with c.stream("POST", "/v1/completions", json={**body, "prompt": "hang up too", "max_tokens": 200,
                                                       "stream": True}) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: {"))
        # A non-streaming client that gives up: noticed while its tokens still flow, long before the end.
        start = time.monotonic()
        try:
            httpx.post(f"{url}/v1/completions", json={**body, "prompt": "give up", "max_tokens": 240}, timeout=0.3)
            raise AssertionError("the request was expected to time out on the client's side")
        except httpx.TimeoutException:
            pass
        wait_for(lambda: metric(url, "vllm:request_success_total", finished_reason="abort") == aborts + 3,
                 "the two clients that hung up among others were not aborted")
        assert time.monotonic() - start < 2.0, "a non-streaming request ran on after its client left"
        for t in threads:
            t.join(60)
        assert texts == {p: expected(p, n) for p, n, _ in keep}
        wait_for(lambda: metric(url, "vllm:kv_cache_usage_perc") == 0, "KV blocks left behind")
        idle(url, state)


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
