"""Prefix caching through ep-serve (real uvicorn servers in front of fake-model rank processes, as in
tests/test_serving_api.py): vllm:prefix_cache_queries / vllm:prefix_cache_hits counted exactly for a
known sequence of requests, POST /reset_prefix_cache (vLLM's development endpoint) reaching every rank,
echo + logprobs the same with caching on and off, --no-enable-prefix-caching turning it off, the flag on
the command line and in the start-up line; --enable-prompt-tokens-details's cached tokens in usage."""

from __future__ import annotations

import dataclasses
import logging
import threading

import httpx
import pytest
from serving_fakes import reference_greedy
from test_serving_api import NAME, check_envelope, complete, fake_server, http_server, scrape, sse_events, total

from serving.api.server import dev_mode_from_env
from serving.cli import build_parser, engine_config, startup_summary
from serving.engine.messages import ModelInfo
from serving.model_config import ModelConfig
from serving.tiny_model import TINY_CONFIG

BLOCK = 4  # fake_config's block_size


@pytest.fixture(scope="module")
def server():
    with fake_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


def prefix_counts(client: httpx.Client) -> tuple[float, float]:
    m = scrape(client)
    return (total(m, "vllm:prefix_cache_queries_total", model_name=NAME, engine="0"),
            total(m, "vllm:prefix_cache_hits_total", model_name=NAME, engine="0"))


def counted(client: httpx.Client, **body) -> tuple[float, float]:
    """One completion (token-id prompt, greedy); the prefix cache counters' growth over it."""
    before = prefix_counts(client)
    resp = complete(client, **body)
    assert resp.status_code == 200, resp.text
    after = prefix_counts(client)
    return after[0] - before[0], after[1] - before[1]


def start_long_stream(url: str) -> threading.Thread:
    """A streamed request of 150 tokens in a thread, returned once its first chunk has come: until it
    ends, it holds KV blocks on its rank."""
    started = threading.Event()

    def run() -> None:
        body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(30)
    return runner


def test_metrics_count_queried_and_cached_tokens_exactly(client):
    """Tokens of each new request's prompt are queried; hits are whole cached blocks, never a prompt's
    last token, generated tokens included; a request for prompt logprobs (echo + logprobs) reads nothing
    and counts nothing."""
    x = [33, 34, 35, 36, 37, 38, 39, 40, 41, 42]  # 10 tokens: 2 full blocks and 2 tokens
    generated = reference_greedy(x, 3, ignore_eos=True)
    assert counted(client, prompt=x, max_tokens=3) == (10, 0)  # computes x and 2 generated tokens: 3 blocks
    assert counted(client, prompt=x, max_tokens=2) == (10, 8)  # 2 blocks: the third holds its last token
    follow = [*x, *generated[:2], 5]  # x, the first answer, one more token: 13 tokens
    assert counted(client, prompt=follow, max_tokens=1) == (13, 12)
    assert counted(client, prompt=[*x, 9], max_tokens=1, echo=True, logprobs=1) == (0, 0)
    m = scrape(client)
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert ((name, (("engine", "0"), ("model_name", NAME)))) in m


def test_reset_prefix_cache_is_a_development_endpoint(client, server, caplog):
    """Without VLLM_SERVER_DEV_MODE there is no route (vLLM's 404); with it, 200 and an empty body. An
    idle rank forgets its cache; one with a request running keeps it and the log says so."""
    check_envelope(client.post("/reset_prefix_cache"), 404)
    assert dev_mode_from_env({}) is False and dev_mode_from_env({"VLLM_SERVER_DEV_MODE": "1"}) is True
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE"):
        dev_mode_from_env({"VLLM_SERVER_DEV_MODE": "yes"})
    x = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    with http_server(dataclasses.replace(server[1], dev_mode=True)) as url, httpx.Client(base_url=url,
                                                                                          timeout=30) as dev:
        assert counted(dev, prompt=x, max_tokens=1) == (9, 0)
        assert counted(dev, prompt=x, max_tokens=1) == (9, 8)
        resp = dev.post("/reset_prefix_cache")
        assert resp.status_code == 200 and resp.content == b""
        assert counted(dev, prompt=x, max_tokens=1) == (9, 0)  # forgotten
        check_envelope(dev.post("/reset_prefix_cache", params={"reset_running_requests": "true"}), 400)
        # A request holding blocks: the rank keeps its cache.
        runner = start_long_stream(url)
        with caplog.at_level(logging.WARNING, logger="serving.api.server"):
            assert dev.post("/reset_prefix_cache").status_code == 200
        runner.join(60)
        assert "prefix cache not reset on rank(s) [0]" in caplog.text
        assert counted(dev, prompt=x, max_tokens=1) == (9, 8)  # still cached


def test_echo_and_logprobs_are_the_same_with_caching_on_and_off(client):
    """echo with prompt logprobs, and completion logprobs, behind a prefix that the caching server holds:
    the same response bodies as a server without caching, whose counters stay at 0."""
    prefix = [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]
    bodies = [dict(prompt=[*prefix, 7, 8], max_tokens=4, echo=True, logprobs=3),
              dict(prompt=[*prefix, 9], max_tokens=5, logprobs=2),
              dict(prompt=[*prefix, 7, 8], max_tokens=0, echo=True, logprobs=2)]

    def answers(c: httpx.Client) -> list[dict]:
        assert complete(c, prompt=prefix, max_tokens=2).status_code == 200  # warm the cache
        out = []
        for body in bodies:
            resp = complete(c, **body)
            assert resp.status_code == 200, resp.text
            out.append({k: v for k, v in resp.json().items() if k not in ("id", "created")})
        return out

    before = prefix_counts(client)
    on = answers(client)
    assert prefix_counts(client)[1] - before[1] == 12  # only the plain logprobs request read the cache
    with fake_server(enable_prefix_caching=False) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        off = answers(c)
        assert prefix_counts(c) == (0, 0)
    assert on == off
    assert on[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the prompt's first token has none


def test_the_reset_reaches_every_rank():
    """Expert parallelism over two ranks: the coordinator asks each between steps; a rank with a
    request running refuses while the idle one resets."""
    with fake_server(data_parallel_size=2, enable_expert_parallel=True) as (url, state):
        assert state.coordinator.reset_prefix_cache() == {0: True, 1: True}
        runner = start_long_stream(url)
        busy = state.coordinator.load().index(1)
        assert state.coordinator.reset_prefix_cache() == {busy: False, 1 - busy: True}
        runner.join(60)


# ---------------------------------------------------------------------------- the flag
def test_the_flag_is_on_by_default_and_turns_off():
    parser = build_parser()
    for argv, on in (([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
        args = parser.parse_args(argv)
        assert engine_config(args, "ckpt", "m").enable_prefix_caching is on, argv
    assert "--no-enable-prefix-caching" in parser.format_help()
    tiny = ModelConfig.from_dict(TINY_CONFIG)
    info = ModelInfo(512, (1,), 2048, 100, 16, "cpu")
    for argv, said in (([], "prefix caching on,"), (["--no-enable-prefix-caching"],
                                                     "prefix caching off (--no-enable-prefix-caching),")):
        config = engine_config(parser.parse_args(argv), "ckpt", "m").resolved(tiny)
        assert said in startup_summary(config, tiny, info, "http://h:1")


def test_usage_says_the_cached_prompt_tokens_with_the_flag(client, server):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is the prompt tokens found in the
    prefix cache, as the hit counter counts them (whole blocks, never a prompt's last token), a prompt once
    however many choices it has, summed over a request's prompts, in a stream's usage chunk too; without the flag
    usage has no prompt_tokens_details (vLLM's)."""
    state = server[1]
    x, y = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21], [22, 24, 26, 28, 30, 32, 34]  # 10 and 7 tokens

    def usage(**body) -> dict:
        resp = complete(client, max_tokens=2, **body)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    assert "prompt_tokens_details" not in usage(prompt=x)  # computes x: 2 full blocks cached after it
    state.prompt_tokens_details = True
    try:
        assert usage(prompt=x)["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK}
        assert usage(prompt=y, n=3)["prompt_tokens_details"] == {"cached_tokens": 0}  # y new; its choices count once
        both = usage(prompt=[x, y])
        assert both["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK + BLOCK} and both["prompt_tokens"] == 17
        body = {"model": NAME, "prompt": y, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": BLOCK}
    finally:
        state.prompt_tokens_details = False


def test_the_prompt_tokens_details_flag():
    parser = build_parser()
    assert parser.parse_args([]).enable_prompt_tokens_details is False
    assert parser.parse_args(["--enable-prompt-tokens-details"]).enable_prompt_tokens_details is True
    assert "--enable-prompt-tokens-details" in parser.format_help()
