"""Connection limits (serving/api/connections.py, docs/reliability.md) on `ep-serve` itself (the built-in
tiny model, one rank, 127.0.0.1 only), with short limits so the test is quick: 500 idle connections and
200 slowloris clients (a header byte every half second) do not keep normal requests from being served,
and the server closes them all once the header-read timeout has passed; a kept-alive connection is
closed when idle; a body that stalls is a 408; a connection past --max-connections gets a 503 at once."""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time

import httpx
import pytest
from deploy_helpers import HOST, EPServe
from test_serving_api import check_envelope

HEADER_READ_S = 3.0
KEEP_ALIVE_S = 2.0
MAX_CONNECTIONS = 800
IDLE, SLOWLORIS = 500, 200
NORMAL = {"prompt": "Connections", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving.tiny_model import tiny_checkpoint

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = MAX_CONNECTIONS + 200
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    cache = tmp_path_factory.mktemp("tiny-cache")
    tiny_checkpoint(str(cache))
    server = EPServe(["--header-read-timeout", str(HEADER_READ_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
                      "--max-connections", str(MAX_CONNECTIONS)], cache, tmp_path_factory.mktemp("log") / "log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=10)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (EOF or a reset), without waiting."""
    sock.setblocking(False)
    try:
        while data := sock.recv(65536):
            if not data:
                break
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def wait_closed(socks: list[socket.socket], timeout_s: float) -> float:
    """Seconds until the server has closed every one of socks; fails after timeout_s."""
    start = time.monotonic()
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    open_ = set(socks)
    while open_:
        left = timeout_s - (time.monotonic() - start)
        assert left > 0, f"{len(open_)} of {len(socks)} connections still open after {timeout_s} s"
        for key, _ in sel.select(min(left, 0.5)):
            if closed_by_server(key.fileobj):
                sel.unregister(key.fileobj)
                open_.discard(key.fileobj)
    return time.monotonic() - start


def test_idle_and_slowloris_connections_are_closed_and_others_served(server):
    port = server.port
    with httpx.Client(base_url=server.url, timeout=10) as c:
        alone = []
        for _ in range(3):
            start = time.monotonic()
            assert c.post("/v1/completions", json=NORMAL).status_code == 200
            alone.append(time.monotonic() - start)
    with contextlib.ExitStack() as stack:
        opened = time.monotonic()
        idle = [stack.enter_context(connect(port)) for _ in range(IDLE)]
        slow = [stack.enter_context(connect(port)) for _ in range(SLOWLORIS)]
        header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "
        for s in slow:
            s.sendall(header[:10])
        served = []
        with httpx.Client(base_url=server.url, timeout=10) as c:
            for i in range(5):  # one header byte a slowloris, every half second, while normal requests run
                for s in slow:
                    with contextlib.suppress(OSError):
                        s.sendall(header[10 + i:11 + i])
                start = time.monotonic()
                resp = c.post("/v1/completions", json=NORMAL)
                assert resp.status_code == 200, resp.text
                served.append(time.monotonic() - start)
                time.sleep(max(0.0, 0.5 - (time.monotonic() - start)))
        wait_closed(idle + slow, HEADER_READ_S + 5)
        since_open = time.monotonic() - opened
    assert since_open >= HEADER_READ_S, f"connections closed after {since_open:.2f} s, before the timeout"
    print(f"alone: {[round(t * 1e3) for t in alone]} ms; with {IDLE} idle + {SLOWLORIS} slowloris connections: "
          f"5 normal requests served in "
          f"{[round(t * 1e3) for t in served]} ms; all closed {since_open:.1f} s after they opened "
          f"(header-read timeout {HEADER_READ_S} s)")


def test_a_kept_alive_connection_is_closed_when_idle(server):
    with connect(server.port) as s:
        body = json.dumps(NORMAL).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        answered = time.monotonic()
        idle_s = wait_closed([s], KEEP_ALIVE_S + 3)
    assert time.monotonic() - answered > KEEP_ALIVE_S - 0.5, f"closed after {idle_s:.2f} s, before the timeout"


@pytest.mark.slow
def test_a_stalled_body_is_a_408(server):
    with connect(server.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"nothing received" in answer and time.monotonic() - start >= HEADER_READ_S - 0.1


def test_a_connection_past_the_limit_gets_a_503_at_once(server):
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(connect(server.port)) for _ in range(MAX_CONNECTIONS)]
        with connect(server.port) as extra:
            start = time.monotonic()
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := extra.recv(65536):
                    answer += chunk
            assert time.monotonic() - start < 2
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
        check_envelope(httpx.Response(503, content=answer.split(b"\r\n\r\n", 1)[1]), 503)
        assert b"too many open connections" in answer
        wait_closed(held, HEADER_READ_S + 5)
    resp = httpx.post(f"{server.url}/v1/completions", json=NORMAL, timeout=10)
    assert resp.status_code == 200, resp.text  # room again once the idle ones were closed
