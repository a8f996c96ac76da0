"""The HTTP server end to end: real uvicorn servers on 127.0.0.1 (free ports) in front of engine rank
processes. With the fake model (tests/serving_fakes.py, exact expected text): the OpenAI API, SSE
streaming, 32 concurrent requests, errors, auth, /metrics counting what the requests did, client
disconnects, expert parallelism over 2 ranks and a dead rank. With the built-in tiny DeepSeek-V3:
`ep-serve` with EP=2 gives the same greedy text as EP=1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from deploy_helpers import ep_serve
from prometheus_client.parser import text_string_to_metric_families
from serving_fakes import VOCAB, FakeTokenizer, reference_greedy

from serving.api.metrics import INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from serving.api.server import ServerState, build_app, make_http_server, make_server_state
from serving.engine.engine_config import EngineConfig

TOK = FakeTokenizer()
NAME = "fake-model"
HOST = "127.0.0.1"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_config(**overrides) -> EngineConfig:
    # The fakes are CPU models: device="cpu" keeps these tests the same on a machine with a GPU.
    base = dict(model="fake-slow", served_model_name=NAME, loader="serving_fakes", max_tokens_per_rank=32,
                max_num_seqs=32, block_size=4, num_kv_blocks=2048, device="cpu")
    return EngineConfig(**{**base, **overrides})


@contextlib.contextmanager
def http_server(state: ServerState, as_run_http: bool = False) -> Iterator[str]:
    """uvicorn serving build_app(state) from a thread, on a port the OS picked; yields the base URL (https where
    state.tls serves it). as_run_http: the server run_http runs (make_http_server: the connection limits, TLS and
    its refresh), else uvicorn's defaults."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY on TCP only
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    server = (make_http_server(state, host=HOST, port=0, log_level="warning") if as_run_http
              else uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning")))
    config = server.config
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"{'https' if config.is_ssl else 'http'}://{HOST}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextlib.contextmanager
def serving(config: EngineConfig, start_timeout_s: float) -> Iterator[tuple[str, ServerState]]:
    """The app over `config`'s engine ranks, in this process: (base URL, state); the ranks stop after."""
    state = make_server_state(config, start_timeout_s=start_timeout_s)
    try:
        with http_server(state) as url:
            yield url, state
    finally:
        state.coordinator.shutdown()


def fake_server(**overrides) -> contextlib.AbstractContextManager[tuple[str, ServerState]]:
    return serving(fake_config(**overrides), 60)


def tiny_server(path: str, **overrides) -> contextlib.AbstractContextManager[tuple[str, ServerState]]:
    """The built-in tiny DeepSeek-V3 at `path` on a CPU rank (8 sequences, T = 64)."""
    base = dict(model=path, device="cpu", max_num_seqs=8, max_tokens_per_rank=64)
    return serving(EngineConfig(**{**base, **overrides}), 120)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    with fake_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


def expected(prompt: str | list[int], max_tokens: int) -> str:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    return TOK.decode(reference_greedy(ids, max_tokens, ignore_eos=True))


def complete(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"model": NAME, "temperature": 0, "ignore_eos": True, **body})


def sse_events(lines: Iterator[str]) -> list[dict | str]:
    events: list[dict | str] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, checked by prometheus_client's parser."""
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


# ---------------------------------------------------------------------------- the API
def test_the_app_loads_what_a_stream_needs_before_its_first_request() -> None:
    """A streamed response opens an anyio task group, whose first use imports anyio's asyncio backend; the app's
    lifespan does that before it takes requests, so the first stream after ready does not wait for the import.
    In a fresh interpreter: not loaded by importing the server, loaded once the lifespan has started."""
    code = (
        "import asyncio, sys\n"
        "from types import SimpleNamespace\n"
        "from serving.api.cors import Cors\n"
        "from serving.api.server import build_app\n"
        "app = build_app(SimpleNamespace(dev_mode=False, openapi=True, cors=Cors(), root_path='',\n"
        "                                request_id_headers=False, tokenizer_info=None))\n"
        "assert 'anyio._backends._asyncio' not in sys.modules, 'already loaded by the imports'\n"
        "async def start():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        assert 'anyio._backends._asyncio' in sys.modules, 'not loaded by the lifespan'\n"
        "asyncio.run(start())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert done.returncode == 0, done.stderr[-2000:]


def test_models_health_version(client):
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["max_model_len"] == 256


def test_several_served_names_are_each_the_model(server):
    """--served-model-name a b: /v1/models lists both, a request may name either (or the path) and its response
    echoes the name it used (the first where it named none or the path); any other name is a 404."""
    state = server[1]
    with http_server(dataclasses.replace(state, served_model_aliases=("alias-1",))) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [NAME, "alias-1"]
        for asked, echoed in ((NAME, NAME), ("alias-1", "alias-1"), (None, NAME), (state.model_path, NAME)):
            body = {"prompt": "ab", "max_tokens": 2} | ({"model": asked} if asked else {})
            assert c.post("/v1/completions", json=body).json()["model"] == echoed, asked
            events = sse_events(c.post("/v1/completions", json={**body, "stream": True}).text.splitlines())
            assert {e["model"] for e in events[:-1]} == {echoed}, asked
        check_envelope(c.post("/v1/completions", json={"prompt": "ab", "model": "alias-2"}), 404)


def test_completion_text_usage_and_finish_reason(client):
    resp = complete(client, prompt="the cat and", max_tokens=10)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == NAME and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == expected("the cat and", 10)
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    n_prompt = len(TOK.encode("the cat and"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 10, "total_tokens": n_prompt + 10}


def test_prompt_forms_and_n(client):
    ids = TOK.encode("hello world")
    for prompt, texts in (
        (ids, [expected(ids, 6)]),
        (["abc", "the dog"], [expected("abc", 6), expected("the dog", 6)]),
        ([ids, [1, 2, 3]], [expected(ids, 6), expected([1, 2, 3], 6)]),
    ):
        body = complete(client, prompt=prompt, max_tokens=6).json()
        assert [c["index"] for c in body["choices"]] == list(range(len(texts)))
        assert [c["text"] for c in body["choices"]] == texts
    body = complete(client, prompt=["ab", "cd"], max_tokens=4, n=2).json()
    assert [c["text"] for c in body["choices"]] == [expected("ab", 4)] * 2 + [expected("cd", 4)] * 2
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 16


def test_stop_string_and_seeded_sampling(client):
    full = expected("stop here", 30)
    stop = full[10:12]
    choice = complete(client, prompt="stop here", max_tokens=30, stop=stop).json()["choices"][0]
    assert choice["text"] == full[:full.find(stop)] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    sampled = [complete(client, prompt="seeded", max_tokens=12, temperature=1.0, seed=7).json()["choices"][0]["text"]
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_streaming_matches_non_streaming(client):
    body = {"model": NAME, "prompt": "stream me", "max_tokens": 14, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 14
    text_chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in text_chunks)
    assert len(text_chunks) == 14  # one per token, text or not (an incomplete UTF-8 piece has none yet)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == expected("stream me", 14)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(client):
    """stream_options {include_usage, continuous_usage_stats} (vLLM's): every chunk carries its choice's prompt
    tokens and the tokens it has made so far; the last chunk the request's usage; without include_usage nothing."""
    prompts = ["stream me", "the cat and the dog"]
    body = {"model": NAME, "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(client.post("/v1/completions", json=body).text.splitlines())
    made: dict[int, int] = {}
    for chunk in events[:-2]:
        (choice,) = chunk["choices"]
        i = choice["index"]
        made[i] = made.get(i, 0) + 1  # a chunk per token
        prompt = len(TOK.encode(prompts[i // 2]))
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": made[i],
                                  "total_tokens": prompt + made[i]}, chunk
    assert made == dict.fromkeys(range(4), 5) and events[-2]["usage"]["completion_tokens"] == 20
    body["stream_options"] = {"continuous_usage_stats": True}
    events = sse_events(client.post("/v1/completions", json=body).text.splitlines())
    assert all("usage" not in e for e in events[:-1])


def test_stream_interval_batches_tokens_into_chunks(server):
    """vLLM's stream_interval: a choice's first token goes at once, then chunks of the interval's tokens (their text
    and logprobs with them), the rest with the end; --stream-interval is the floor a request may raise."""
    body = {"model": NAME, "prompt": "stream me", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    whole = httpx.post(f"{server[0]}/v1/completions", json={**body, "stream": False}, timeout=30).json()["choices"][0]
    for floor, asked, sizes in ((1, 4, [1, 4, 4, 1]), (3, 2, [1, 3, 3, 3]), (3, None, [1, 3, 3, 3])):
        with http_server(dataclasses.replace(server[1], stream_interval=floor)) as url:
            events = sse_events(httpx.post(f"{url}/v1/completions", timeout=30,
                                           json=body | ({"stream_interval": asked} if asked else {})).text.splitlines())
        choices = [e["choices"][0] for e in events[:-1]]
        assert [len(c["logprobs"]["tokens"]) for c in choices] == sizes, (floor, asked)
        assert "".join(c["text"] for c in choices) == whole["text"]
        assert [t for c in choices for t in c["logprobs"]["token_logprobs"]] == whole["logprobs"]["token_logprobs"]
        assert [c["finish_reason"] for c in choices] == [None] * (len(sizes) - 1) + ["length"]


def test_one_stream_has_one_created_time(client):
    """Every chunk of a stream that runs past a second boundary carries the response's one `created`."""
    body = {"model": NAME, "prompt": "a long one", "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.time()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        events = sse_events(resp.iter_lines())
    assert int(time.time()) > int(start), "the stream ended within one second: it tests nothing"
    created = {c["created"] for c in events[:-1]}
    assert len(created) == 1 and int(start) <= created.pop() <= int(time.time()), events[:2]


def test_32_concurrent_requests(server):
    url = server[0]
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompts = [f"{letters[i % 26]} {letters[5 * i % 26]} {'the ' * (i % 4)}dog" for i in range(32)]

    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": 8 + i % 5, "temperature": 0, "ignore_eos": True}
        if i % 2:
            body["stream"] = True
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                events = sse_events([line async for line in resp.aiter_lines()])
            assert events[-1] == "[DONE]"
            return "".join(e["choices"][0]["text"] for e in events[:-1])
        resp = await c.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(32))), 60)

    got = asyncio.run(all_of_them())
    assert got == [expected(p, 8 + i % 5) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": [-1, 2]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": [[1], [10 ** 30]]}, "prompt"),
    ({"prompt": "a" * 300}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 255}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 10 ** 40}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "ab", "max_tokens": True}, "max_tokens"),
    ({"prompt": "ab", "temperature": -0.1}, "temperature"),
    ({"prompt": "ab", "temperature": "hot"}, "temperature"),
    ({"prompt": "ab", "top_p": 0}, "top_p"),
    ({"prompt": "ab", "top_p": 1.5}, "top_p"),
    ({"prompt": "ab", "top_k": -2}, "top_k"),
    ({"prompt": "ab", "n": 0}, "n"),
    ({"prompt": "ab", "n": 1000}, "n"),
    ({"prompt": "ab", "seed": 2 ** 64}, "seed"),
    ({"prompt": "ab", "stream": "yes"}, "stream"),
    ({"prompt": "ab", "stop": [""]}, "stop"),
    ({"prompt": "ab", "stop": 3}, "stop"),
    ({"prompt": "ab", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "ab", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "ab", "logprobs": 21}, "logprobs"),
    ({"prompt": "ab", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "ab", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "ab", "model": 3}, "model"),
    ({}, "prompt"),
]


def check_envelope(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    return err


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_are_400(client, body, param):
    err = check_envelope(client.post("/v1/completions", json=body), 400)
    assert err["type"] == "BadRequestError"
    assert err["param"] is None or err["param"].split(".")[0] == param


def test_prompt_errors_are_the_engines(client):
    """The server refuses a prompt with the engine's own check (sequence.check_prompt) and its words."""
    err = check_envelope(complete(client, prompt=[[1], [2, VOCAB]]), 400)
    assert err["message"] == f"prompt[1]: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    err = check_envelope(complete(client, prompt=[1] * 250, max_tokens=7), 400)
    assert err["param"] == "max_tokens" and err["message"].startswith(
        "This model's maximum context length (max_model_len) is 256 tokens. However, you requested 257 tokens")


def test_malformed_bodies_are_400(client):
    for raw in (b"{", b"[1, 2]", b"null", b'{"prompt": "ab", "temperature": NaN}',
                b'{"prompt": "ab", "temperature": Infinity}', "é".encode("latin-1")):
        check_envelope(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)


def test_unknown_model_is_404_and_unknown_route_is_enveloped(client):
    err = check_envelope(complete(client, prompt="ab", model="gpt-17"), 404)
    assert err["type"] == "NotFoundError" and "gpt-17" in err["message"]
    check_envelope(client.get("/v1/nothing-here"), 404)


def test_api_key(server):
    state = server[1]
    with http_server(dataclasses.replace(state, api_key="sekrit")) as keyed, httpx.Client(base_url=keyed) as c:
        check_envelope(c.get("/v1/models"), 401)
        check_envelope(c.get("/version"), 401)
        check_envelope(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        check_envelope(c.post("/v1/completions", json={"prompt": "ab"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


# ---------------------------------------------------------------------------- metrics
def test_metrics_count_what_the_requests_did(client):
    before = scrape(client)
    prompts = ["metric one", "metric two and more", "m"]
    for i, p in enumerate(prompts):
        assert complete(client, prompt=p, max_tokens=5 + i).status_code == 200
    stop_full = expected("metric stop", 20)
    assert complete(client, prompt="metric stop", max_tokens=20, stop=stop_full[6:8]).status_code == 200
    after = scrape(client)

    def delta(name: str, **labels) -> float:
        return total(after, name, model_name=NAME, **labels) - total(before, name, model_name=NAME, **labels)

    gen = 5 + 6 + 7 + len(TOK.encode(stop_full[:stop_full.find(stop_full[6:8])])) + 1
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:prompt_tokens_total") == sum(len(TOK.encode(p)) for p in [*prompts, "metric stop"])
    assert delta("vllm:generation_tokens_total") == gen
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:request_queue_time_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == gen - 4
    prompt_tokens = sum(len(TOK.encode(p)) for p in [*prompts, "metric stop"])
    assert (delta("vllm:request_prompt_tokens_count"), delta("vllm:request_prompt_tokens_sum")) == (4, prompt_tokens)
    assert (delta("vllm:request_generation_tokens_count"), delta("vllm:request_generation_tokens_sum")) == (4, gen)
    phases = {name: delta(f"vllm:request_{name}_seconds_sum") for name in ("prefill_time", "decode_time",
                                                                          "inference_time")}
    assert all(delta(f"vllm:request_{name}_seconds_count") == 4 for name in phases)
    assert phases["inference_time"] == pytest.approx(phases["prefill_time"] + phases["decode_time"])
    assert delta("vllm:request_time_per_output_token_seconds_count") == 4
    assert delta("vllm:num_preemptions_total") == 0
    assert total(after, "vllm:num_requests_running", model_name=NAME) == 0
    assert total(after, "vllm:kv_cache_usage_perc", model_name=NAME) == 0
    assert (("vllm:num_requests_waiting", (("engine", "0"), ("model_name", NAME)))) in after
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                          ("vllm:inter_token_latency_seconds", INTER_TOKEN_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
                          ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)):
        les = sorted(float(dict(ls)["le"]) for (n, ls), _ in after.items() if n == f"{name}_bucket")
        assert les == [*buckets, float("inf")], name
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert total(after, "ep_layer:engine_steps_total", model_name=NAME) > 0


def test_metrics_count_a_prompt_once_and_only_the_tokens_usage_reports(client):
    """n choices share their prompt: its tokens count once, as usage.prompt_tokens does, and the request's n
    once (vLLM's parent request), with the most tokens a choice generated. An echo of the prompt alone
    (max_tokens 0) reports no completion token, and the metrics count none either."""
    before = scrape(client)
    for body in ({"prompt": "three choices", "max_tokens": 4, "n": 3},
                 {"prompt": ["just the prompt", "and another"], "max_tokens": 0, "echo": True}):
        resp = complete(client, **body)
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        after = scrape(client)
        names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_params_n_count",
                 "vllm:request_params_n_sum", "vllm:request_max_num_generation_tokens_sum")
        delta = {name: total(after, name, model_name=NAME) - total(before, name, model_name=NAME) for name in names}
        prompts = 1 if isinstance(body["prompt"], str) else len(body["prompt"])
        n = body.get("n", 1)
        assert delta == {"vllm:prompt_tokens_total": usage["prompt_tokens"],
                         "vllm:generation_tokens_total": usage["completion_tokens"],
                         "vllm:request_params_n_count": prompts, "vllm:request_params_n_sum": prompts * n,
                         # ignore_eos: every choice generates max_tokens
                         "vllm:request_max_num_generation_tokens_sum": prompts * body["max_tokens"]}, (body, usage)
        before = after


def test_client_disconnect_aborts_the_request(client, server):
    before = scrape(client)
    body = {"model": NAME, "prompt": "a long one", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # first chunk in: hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = scrape(client)
        aborted = (total(after, "vllm:request_success_total", model_name=NAME, finished_reason="abort")
                   - total(before, "vllm:request_success_total", model_name=NAME, finished_reason="abort"))
        if aborted == 1 and total(after, "vllm:kv_cache_usage_perc", model_name=NAME) == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the request was not aborted after the client went away")
    assert server[1].coordinator.load() == [0]


# ---------------------------------------------------------------------------- expert parallelism (fake model)
def test_expert_parallel_fake_two_ranks_and_a_dead_rank():
    with fake_server(data_parallel_size=2, enable_expert_parallel=True) as (url, state):
        prompts = [f"ep {'abcdefgh'[i]} the cat" for i in range(8)]

        async def run_all() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                resps = await asyncio.wait_for(asyncio.gather(*(
                    c.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 10, "temperature": 0,
                                                    "ignore_eos": True}) for p in prompts)), 60)
            return [r.json()["choices"][0]["text"] for r in resps]

        assert asyncio.run(run_all()) == [expected(p, 10) for p in prompts]
        with httpx.Client(base_url=url, timeout=30) as c:
            m = scrape(c)
            for rank in ("0", "1"):  # both ranks served requests (least-loaded routing)
                assert total(m, "vllm:request_success_total", engine=rank) > 0
            assert c.get("/health").status_code == 200
            state.coordinator._procs[1].kill()
            deadline = time.monotonic() + 20
            while c.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 after a rank died"
                time.sleep(0.1)
            check_envelope(c.get("/health"), 503)
            check_envelope(complete(c, prompt="ab", max_tokens=2), 503)


# ---------------------------------------------------------------------------- ep-serve on the tiny model
@pytest.mark.slow
def test_ep_serve_tiny_model_ep2_matches_ep1(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tiny-cache"))
    from serving.tiny_model import tiny_checkpoint

    tiny_checkpoint(cache)  # written once, up front, for both servers
    prompts = ["The quick brown fox", "Expert parallelism keeps", "Hello! How are you", "def forward(self, x):"]

    def generate(url: str) -> list[str]:
        async def run_all() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=90) as c:
                resps = await asyncio.wait_for(asyncio.gather(*(
                    c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                    "ignore_eos": True}) for p in prompts)), 90)
            assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
            assert {r.json()["model"] for r in resps} == {"ep-layer-tiny"}
            return [r.json()["choices"][0]["text"] for r in resps]
        return asyncio.run(run_all())

    logs = tmp_path_factory.mktemp("logs")
    with ep_serve(["--enable-expert-parallel", "--data-parallel-size", "2"], cache, logs / "ep2.log") as ep2, \
            ep_serve([], cache, logs / "ep1.log") as ep1:
        texts_ep1, texts_ep2 = generate(ep1.url), generate(ep2.url)
        assert texts_ep2 == texts_ep1
        assert all(texts_ep1)
        m = httpx.get(f"{ep2.url}/metrics", timeout=30).text
        assert 'ep_layer:expert_tokens_total{expert="15",layer="1",model_name="ep-layer-tiny"}' in m


def test_ep_serve_help_names_every_flag():
    out = subprocess.run([sys.executable, "-m", "serving.cli", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": _ROOT}, check=True).stdout
    assert out.startswith("usage: ep-serve")
    for flag in ("MODEL", "--enable-expert-parallel", "--data-parallel-size", "--ep-backend", "--host", "--port",
                 "--served-model-name", "--max-model-len", "--max-num-seqs", "--api-key", "--max-tokens-per-rank"):
        assert flag in out, flag
    assert "127.0.0.1" in out and "{auto,cuda,reference}" in out
