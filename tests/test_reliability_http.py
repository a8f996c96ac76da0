"""Hostile HTTP input and security (docs/reliability.md), against a real uvicorn server on 127.0.0.1 in
front of an engine rank running the fake model (tests/serving_fakes.py):

- fuzzing with hypothesis: /v1/completions bodies whose every field may be of the wrong type, negative,
  huge, NaN, a lone surrogate (invalid UTF-8 once encoded), a token id outside the vocabulary or an
  oversized prompt; raw bodies (random bytes, broken or deeply nested JSON, any content type); every
  route with any method. Only 2xx and 4xx answers, errors in the envelope, never a traceback;
- bounds: body size (413, at once), prompt and max_tokens length, prompts x n, stop lists;
- the API key on every route but the exempt ones, and internal errors that name no internals.
The sampler's own fuzzing, and every numeric field at the extremes, are in test_reliability_sampling.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fakes import VOCAB
from test_serving_api import NAME, check_envelope, fake_config, http_server, sse_events

from serving.api.protocol import MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from serving.api.server import ServerState, build_app, make_server_state
from serving.engine.sequence import MAX_STOP_CHARS

MAX_MODEL_LEN = 256  # the fake model's
CASES: Counter[str] = Counter()  # requests sent, by test (and status), for docs/reliability.md
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    state = make_server_state(fake_config(model="fake"), start_timeout_s=60)
    try:
        with http_server(state) as url:
            yield url, state
    finally:
        state.coordinator.shutdown()
        print(f"requests sent: {dict(sorted(CASES.items()))}")


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def check_answer(resp: httpx.Response, stream: bool = False) -> None:
    """2xx or 4xx; an error is the envelope with no traceback in it; a stream ends with [DONE]."""
    assert resp.status_code < 500, resp.text
    assert "Traceback" not in resp.text and 'File "' not in resp.text, resp.text
    if resp.status_code >= 400:
        check_envelope(resp, resp.status_code)
    elif stream:
        events = sse_events(resp.text.splitlines())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]


def post_raw(client: httpx.Client, content: bytes, content_type: str | None = "application/json",
             path: str = "/v1/completions") -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(path, content=content, headers=headers)


# ---------------------------------------------------------------------------- strategies
# Any code point, lone surrogates (invalid once encoded as UTF-8) made frequent.
ANY_TEXT = st.text(st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=20)
# Text the fake tokenizer takes (its pieces).
ENCODABLE = st.lists(st.sampled_from([*"abcdefghijklmnopqrstuvwxyz .,!?", "é", "€", "日本"]), max_size=40).map("".join)
HUGE = st.integers(min_value=-(1 << 80), max_value=1 << 80)
LEAF = st.none() | st.booleans() | HUGE | st.floats() | ANY_TEXT
ANY_JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
                        max_leaves=8)
TOKEN = st.integers(-3, VOCAB + 3) | HUGE
PROMPT = st.one_of(ENCODABLE, ANY_TEXT, st.lists(ENCODABLE, max_size=4), st.lists(TOKEN, max_size=40),
                   st.lists(st.lists(TOKEN, max_size=10), max_size=4),
                   st.text(alphabet="ab ", min_size=250, max_size=600),
                   st.lists(st.integers(0, VOCAB - 1), min_size=250, max_size=600))
FLOAT = st.floats(-2, 5) | st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 1e308, -0.0, math.inf, -math.inf, math.nan])


def field(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right kind (valid or not), sometimes any JSON at all."""
    return st.one_of(good, good, good, ANY_JSON)


BODY = st.fixed_dictionaries({"prompt": field(PROMPT)}, optional={
    "model": field(st.sampled_from([NAME, "fake-slow", "gpt-4", ""]) | ANY_TEXT),
    "max_tokens": field(st.integers(-5, MAX_MODEL_LEN + 5) | HUGE | st.none()),
    "temperature": field(FLOAT), "top_p": field(FLOAT), "top_k": field(st.integers(-3, VOCAB + 3) | HUGE),
    "n": field(st.integers(-2, MAX_N + 2)), "seed": field(HUGE),
    "stop": field(ANY_TEXT | st.lists(ANY_TEXT, max_size=MAX_STOP_STRINGS + 2)),
    "stop_token_ids": field(st.lists(TOKEN, max_size=8)), "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()), "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(ANY_TEXT), "echo": field(st.booleans()), "logprobs": field(st.integers(-1, 5)),
    "best_of": field(st.integers(0, 3)), "suffix": field(ANY_TEXT),
    "logit_bias": field(st.dictionaries(ANY_TEXT, FLOAT)),
    "presence_penalty": field(FLOAT), "frequency_penalty": field(FLOAT), "repetition_penalty": field(FLOAT),
    "unknown_field": ANY_JSON})


# ---------------------------------------------------------------------------- fuzzing
@settings(max_examples=300, **FUZZ)
@given(body=BODY)
def test_fuzzed_completion_bodies_get_2xx_or_4xx(client, body):
    # Encoded here, not by httpx: lone surrogates go out as \ud800 escapes, NaN and Infinity as JSON does.
    resp = post_raw(client, json.dumps(body).encode())
    CASES[f"completion bodies {resp.status_code}"] += 1
    check_answer(resp, stream=body.get("stream") is True)


# Valid bodies at the edges of what the API accepts: each must be served (200), with every choice.
EDGE_BODY = st.fixed_dictionaries({
    "prompt": st.one_of(ENCODABLE.filter(str.strip), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60),
                        st.lists(st.text(alphabet="abc ", min_size=1, max_size=9), min_size=1, max_size=3)),
    "max_tokens": st.sampled_from([None, *range(1, 25)]),  # None: up to max_model_len
    "temperature": st.sampled_from([0.0, 5e-324, 1e-300, 1e-5, 1e-3, 0.7, 2.0, 1e30, 1e308]),
    "top_p": st.sampled_from([5e-324, 1e-9, 0.5, 1.0]),
    "top_k": st.integers(-1, VOCAB + 2) | st.integers(VOCAB, 1 << 80),
    "n": st.integers(1, 4), "seed": st.none() | st.integers(-(1 << 63), (1 << 64) - 1),
    "stop": st.none() | st.lists(st.text(alphabet="abcdefghij é", min_size=1, max_size=3), max_size=4),
    "stop_token_ids": st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=4), "ignore_eos": st.booleans(),
    "stream": st.booleans()}).map(lambda b: {**b, "stream_options": {"include_usage": True}} if b["stream"] else b)


@pytest.mark.slow
@settings(max_examples=150, **FUZZ)
@given(body=EDGE_BODY)
def test_fuzzed_valid_bodies_at_the_edges_are_served(client, body):
    resp = post_raw(client, json.dumps(body).encode())
    CASES[f"edge bodies {resp.status_code}"] += 1
    assert resp.status_code == 200, resp.text
    prompts = body["prompt"]
    want = body["n"] * (len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], str) else 1)
    if body["stream"]:
        events = sse_events(resp.text.splitlines())
        assert events[-1] == "[DONE]" and "error" not in str(events), events[-3:]
        finished = sorted(c["index"] for e in events[:-2] for c in e["choices"] if c["finish_reason"])
    else:
        finished = sorted(c["index"] for c in resp.json()["choices"] if c["finish_reason"])
    assert finished == list(range(want))


HOSTILE_BODIES = [
    b"", b"{", b"[]", b"null", b"1e999", b"[" * 10_000, b'{"prompt":' + b"[" * 100_000, b'{"prompt": "ab"}' * 3,
    b'{"prompt": "\\ud800"}', b'{"prompt": ["ok", "\\udfff"]}', b'{"prompt": "a", "model": "\\ud83d"}',
    b'{"prompt": "a", "stop": "\\udc00"}', b'{"prompt": "a", "stop": ["\\udc00x"]}', b'{"prompt": "a\\u0000b"}',
    b'{"prompt": "a", "user": "\\ud800\\ud800"}', b'{"prompt": "a", "suffix": "\\ud800"}',
    b'{"prompt": "ab", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "ab", "temperature": -Infinity}',
    b'{"prompt": "ab", "temperature": NaN}', b'{"prompt": "ab", "seed": 1e400}', b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "\xc3"}',
    b'{"prompt": [1, 2], "stop_token_ids": [-1]}', b'{"prompt": [[1], []]}', b'{"prompt": {"a": 1}}',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content", HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_hostile_bodies_get_4xx(client, content, path):
    """Bad for a completion; the other routes ignore some of these fields, so 2xx or 4xx there."""
    resp = post_raw(client, content, path=path)
    CASES[f"hostile bodies {resp.status_code}"] += 1
    check_answer(resp)
    if path == "/v1/completions":
        assert 400 <= resp.status_code < 500, resp.text


# JSON that json.loads decodes although RFC 8259 wants plain UTF-8: served or refused, never a 5xx.
ODD_BODIES = ['{"prompt": "é", "max_tokens": 2}'.encode("utf-16"), b'\xef\xbb\xbf{"prompt": "ab", "max_tokens": 2}']
RAW = st.one_of(st.binary(max_size=200), st.text(max_size=100).map(str.encode),
                st.sampled_from(HOSTILE_BODIES + ODD_BODIES))
CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "\x7f"])


@settings(max_examples=200, **FUZZ)
@given(content=RAW, content_type=CONTENT_TYPES)
def test_fuzzed_raw_bodies_get_4xx(client, content, content_type):
    resp = post_raw(client, content, content_type)
    CASES[f"raw bodies {resp.status_code}"] += 1
    check_answer(resp)


PATHS = st.sampled_from(["/v1/completions", "/v1/models", "/health", "/version", "/metrics", "/", "/v1",
                         "/v1/chat/completions", "/docs", "/openapi.json", "/v1/completions/", "//v1/models",
                         "/%2e%2e/etc/passwd", "/v1/models/fake-model"]) | st.text(alphabet="/abcdv1.%-_", max_size=30)
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


@settings(max_examples=200, **FUZZ)
@given(method=METHODS, path=PATHS, query=st.dictionaries(st.text(max_size=5), st.text(max_size=10), max_size=3),
       content=st.one_of(st.just(b""), RAW))
def test_fuzzed_routes_and_methods_get_2xx_or_4xx(client, method, path, query, content):
    # One leading slash: httpx refuses a path that starts with "//" (a host, to it) before sending anything.
    resp = client.request(method, "/" + path.lstrip("/"), params=query, content=content)
    CASES[f"routes and methods {resp.status_code}"] += 1
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400 and method != "HEAD":
        check_answer(resp)


# ---------------------------------------------------------------------------- bounds
def test_oversized_and_out_of_range_inputs_are_400(server, client):
    capacity = server[1].capacity
    cases = [
        ({"prompt": "ab " * 100_000}, "max_tokens"),  # 300 kB of text: longer than the model
        ({"prompt": list(range(VOCAB)) * 4_000}, "max_tokens"),  # 256k token ids
        ({"prompt": [[1]] * (capacity + 1)}, "n"),  # more sequences than the server holds
        ({"prompt": ["ab"] * (capacity // MAX_N + 1), "n": MAX_N}, "n"),
        ({"prompt": "ab", "n": MAX_N + 1}, "n"),
        ({"prompt": "ab", "max_tokens": 10 ** 100}, "max_tokens"),
        ({"prompt": "ab", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": [VOCAB]}, "prompt"), ({"prompt": [1 << 70]}, "prompt"), ({"prompt": [-1]}, "prompt"),
        ({"prompt": "ab", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "ab", "stop": ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)]}, "stop"),
        ({"prompt": "ab " * 100_000, "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),  # before tokenizing
        ({"prompt": "ab", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"prompt": "ABC"}, "prompt"),  # text the (fake) tokenizer cannot encode
    ]
    for body, param in cases:
        CASES["bounds"] += 1
        resp = client.post("/v1/completions", json=body)
        err = check_envelope(resp, 400)
        assert err["param"] == param, (str(body)[:80], err)
    for raw, param in ((b'{"prompt": "a\\ud800b"}', "prompt"), (b'{"prompt": "ab", "model": "\\udfff"}', "model")):
        CASES["bounds"] += 1
        err = check_envelope(post_raw(client, raw), 400)
        assert err["param"] == param and "surrogate" in err["message"], err


def test_tiny_temperatures_are_greedy_and_leave_the_engine_alive(server, client):
    greedy = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 8, "temperature": 0}).json()
    for t in (1e-300, 5e-324, 1e-6):
        CASES["bounds"] += 1
        resp = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 8, "temperature": t})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert server[1].coordinator.alive and client.get("/health").status_code == 200


def raw_http(url: str, request: bytes) -> bytes:
    """Send raw bytes on a fresh connection; the whole answer, as the server wrote it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)  # with Connection: close: the server closes once it has answered
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def test_request_body_size_is_bounded(server):
    limit = 1 << 16
    with http_server(dataclasses.replace(server[1], max_body_bytes=limit)) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        CASES["bounds"] += 4
        small = json.dumps({"prompt": "ab", "max_tokens": 2, "user": "x" * (limit - 100)}).encode()
        assert c.post("/v1/completions", content=small, headers={"content-type": "application/json"}).status_code == 200
        # Content-Length over the limit: 413 at once, before any of the body is read (none is sent).
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               f"Content-Length: {1 << 40}\r\nConnection: close\r\n\r\n".encode()
        answer = raw_http(url, head)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"RequestTooLargeError" in answer, answer[:300]
        # Chunked, no length: read up to the limit, then 413.
        chunk = b"x" * 8192
        body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + body * (limit // len(chunk) + 1)
        answer = raw_http(url, chunked)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"RequestTooLargeError" in answer, answer[:300]
        # Chunked and within the limit: served.
        ok = json.dumps({"prompt": "ab", "max_tokens": 2}).encode()
        answer = raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                               + f"{len(ok):x}\r\n".encode() + ok + b"\r\n0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# ---------------------------------------------------------------------------- security
def test_the_api_key_guards_every_route_but_the_exempt_ones(server):
    routes = sorted({(r.path, m) for r in build_app(server[1]).routes for m in getattr(r, "methods", ()) or ()
                     if m != "HEAD"})
    assert ("/v1/completions", "POST") in routes and ("/metrics", "GET") in routes
    assert ("/openapi.json", "GET") in routes  # FastAPI's schema: guarded like the rest
    unknown = [("/v1/nothing", "GET"), ("/", "POST"), ("/docs", "GET")]
    for open_paths in (frozenset({"/health", "/metrics"}), frozenset({"/health"}), frozenset()):
        state = dataclasses.replace(server[1], api_key="sekrit", open_paths=open_paths)
        with http_server(state) as url, httpx.Client(base_url=url, timeout=30) as c:
            for path, method in routes + unknown:
                CASES["api key"] += 4
                body = {"prompt": "ab", "max_tokens": 1} if method == "POST" else None
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                    resp = c.request(method, path, json=body, headers=headers)
                    if path in open_paths:
                        assert resp.status_code == 200, (path, resp.text)
                    else:
                        assert check_envelope(resp, 401)["type"] == "UnauthorizedError", (path, headers)
                resp = c.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
                assert resp.status_code != 401 and resp.status_code < 500, (path, resp.text)
                # Two Authorization headers, the right key in either: ambiguous, so refused either way.
                for pair in (["Bearer wrong", "Bearer sekrit"], ["Bearer sekrit", "Bearer wrong"]):
                    headers = [("Authorization", value) for value in pair]
                    resp = c.request(method, path, json=body, headers=headers)
                    if path not in open_paths:
                        assert "one Authorization header" in check_envelope(resp, 400)["message"], (path, pair)


def test_a_long_model_name_is_not_echoed_whole(client):
    name = "m" * (1 << 20)
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/tokenize", {"prompt": "ab"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]})):
        resp = client.post(path, json={**body, "model": name})
        err = check_envelope(resp, 404)
        assert len(resp.content) < 1000 and f"({len(name)} characters)" in err["message"], (path, err["message"][:300])


def test_a_stream_that_fails_in_the_server_ends_with_an_error_event_then_done(server):
    """A bug of the server's while it writes a stream (here: its tokenizer raising on a logprob's token
    string) ends that stream as the protocol says, an error event naming only the exception type and
    then [DONE], and the next request is served."""
    state = server[1]

    class DecodeRaises:
        def encode(self, text: str) -> list[int]:
            return state.codec.encode(text)

        def decode(self, ids: list[int]) -> str:
            raise RuntimeError("secret detail at /srv/model/tokenizer.json")

    broken = dataclasses.replace(state, codec=DecodeRaises(), tokenizer=None)
    with http_server(broken) as url, httpx.Client(base_url=url, timeout=30) as c:
        CASES["stream failing in the server"] += 1
        body = {"prompt": "ab", "max_tokens": 4, "temperature": 0, "logprobs": 1, "stream": True}
        resp = c.post("/v1/completions", json=body)
        events = sse_events(resp.text.splitlines())
        assert resp.status_code == 200 and events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == 500 and "RuntimeError" in events[-2]["error"]["message"], events[-2]
        assert "secret" not in resp.text and "Traceback" not in resp.text
        assert c.post("/v1/completions", json={**body, "logprobs": None}).status_code == 200


def test_internal_errors_name_no_internals(server):
    class Broken:
        def encode(self, text: str) -> list[int]:
            raise RuntimeError("secret detail at /srv/model/tokenizer.json")

        def decode(self, ids: list[int]) -> str:
            return ""

    with http_server(dataclasses.replace(server[1], codec=Broken())) as url, httpx.Client(base_url=url) as c:
        CASES["internal error"] += 1
        resp = c.post("/v1/completions", json={"prompt": "ab"})
        err = check_envelope(resp, 500)
        assert err["type"] == "InternalServerError" and "RuntimeError" in err["message"]
        assert "secret" not in resp.text and "Traceback" not in resp.text and "/srv" not in resp.text

