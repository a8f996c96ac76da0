"""Faults of the serving process tree (docs/reliability.md), on 127.0.0.1 only:

- `ep-serve` (built-in tiny model, 2 expert-parallel ranks) whose rank is killed: /health answers 503
  within seconds, requests in flight end with a clear error (a stream with an error event and
  `data: [DONE]`, a plain request with a 503 envelope) instead of hanging, new ones get 503 at once;
  SIGTERM then stops the whole tree, exit status 0.
- SIGTERM with a request in flight: it is served to the end, then the tree stops (exit status 0, no
  rank left). The same server shows the command line's security and backpressure flags at work: it
  binds to 127.0.0.1 only, --api-key-exempt-paths, --max-num-seqs / --max-waiting-seqs.
- A rank that dies of an exception (tests/reliability_fakes.py): its traceback goes to the log, never
  into a response body.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_helpers import EPServe
from reliability_fakes import POISON
from test_serving_api import check_envelope, fake_config, http_server, sse_events

from serving.api.server import make_server_state

LONG = 1500  # tokens: far more than a test waits for


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> str:
    from serving.tiny_model import tiny_checkpoint

    cache = str(tmp_path_factory.mktemp("tiny-cache"))
    tiny_checkpoint(cache)  # written once, before any server starts
    return cache


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def descendants(pid: int) -> list[int]:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {p: _ppid(p) for p in pids}
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    port: int
    log: Path

    def ranks(self) -> list[int]:
        """The engine rank processes (multiprocessing spawn children; not its resource tracker)."""
        found = []
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(pid)
        return sorted(found)

    def stop(self, timeout_s: float = 30.0) -> tuple[int, float]:
        """SIGTERM; (exit status, seconds it took)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout_s)
        return rc, time.monotonic() - start


@contextlib.contextmanager
def ep_serve(cache: str, log: Path, *args: str) -> Iterator[Served]:
    server = EPServe(list(args), cache, log)
    proc = server.proc
    tree: list[int] = []
    try:
        server.wait_healthy()
        tree = descendants(proc.pid)
        yield Served(proc, server.url, server.port, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in tree:  # whatever this server started and left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def listen_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def stream_in_thread(url: str, body: dict, first: threading.Event, result: dict,
                     headers: dict[str, str] | None = None) -> threading.Thread:
    """POST a streaming request from a thread; `first` is set at its first chunk, `result` gets its
    events (or the exception) and the time it ended."""

    def run() -> None:
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=60) as c, \
                    c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                result["status"] = resp.status_code
                lines = []
                for line in resp.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        first.set()
                result["events"] = sse_events(lines)
        except Exception as e:
            result["error"] = e
        finally:
            result["ended"] = time.monotonic()
            first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text, text


# ---------------------------------------------------------------------------- a rank dies
@pytest.mark.slow
def test_killed_rank_health_503_requests_fail_cleanly_and_sigterm_stops_the_tree(tiny_cache, tmp_path):
    with ep_serve(tiny_cache, tmp_path / "ep-serve.log", "--enable-expert-parallel", "--data-parallel-size", "2") as s:
        ranks = s.ranks()
        assert len(ranks) == 2, ranks
        body = {"prompt": "The quick brown fox", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        first, streamed = threading.Event(), {}
        stream = stream_in_thread(s.url, body, first, streamed)
        plain: dict = {}

        def post() -> None:
            plain["resp"] = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt": "Hello"}, timeout=60)
            plain["ended"] = time.monotonic()

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        assert first.wait(60) and "error" not in streamed, streamed
        time.sleep(0.3)  # the plain request is in too
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)

        with httpx.Client(base_url=s.url, timeout=10) as c:
            while (health := c.get("/health")).status_code != 503:
                assert time.monotonic() - killed < 5, "/health still 200 five seconds after a rank died"
                time.sleep(0.05)
            health_s = time.monotonic() - killed
            err = check_envelope(health, 503)
            # The rank that died, whoever noticed first (the server, or a peer whose collective broke),
            # and nothing of the library's message about the broken connection (no address or port).
            assert "rank(s) [1] exited" in err["message"], err
            assert not re.search(r"\d+\.\d+\.\d+\.\d+|:\d+|/", err["message"]), err
            stream.join(30)
            poster.join(30)
            assert not stream.is_alive() and not poster.is_alive(), "a request in flight hung after the rank died"
            events = streamed["events"]
            assert streamed["status"] == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert events[-2]["error"]["code"] == 503 and "rank(s) [1] exited" in events[-2]["error"]["message"], \
                events[-2]
            assert all("error" not in e for e in events[:-2])  # text chunks, then the error, then [DONE]
            check_envelope(plain["resp"], 503)
            assert max(streamed["ended"], plain["ended"]) - killed < 5
            start = time.monotonic()
            check_envelope(c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}), 503)
            assert time.monotonic() - start < 1
            assert c.get("/metrics").status_code == 200  # the server itself lives on
            # Both ranks gone, reaped by the server that lives on: no zombie left waiting for its shutdown.
            wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in ranks), 5, "both ranks reaped")
            for text in (health.text, plain["resp"].text, str(events)):
                no_traceback(text)
        print(f"rank killed: /health 503 after {health_s:.2f} s, requests in flight ended after "
              f"{max(streamed['ended'], plain['ended']) - killed:.2f} s")
        rc, took = s.stop()
        assert rc == 0, f"exit status {rc}:\n{s.log.read_text()[-3000:]}"
        assert not [p for p in ranks if alive(p)]
        print(f"SIGTERM: exit status {rc} after {took:.2f} s")


# ---------------------------------------------------------------------------- the server dies
@pytest.mark.slow
@pytest.mark.parametrize("busy", [True, False], ids=["busy", "idle"])
def test_ranks_exit_within_two_seconds_of_a_killed_server(tiny_cache, tmp_path, busy):
    """SIGKILL of the server process (no chance to stop its ranks): the ranks notice and exit, busy in a
    step with streams in flight (their outputs filling a pipe nobody reads) or idle."""
    with ep_serve(tiny_cache, tmp_path / "ep-serve.log", "--enable-expert-parallel", "--data-parallel-size", "2") as s:
        ranks = s.ranks()
        assert len(ranks) == 2, ranks
        if busy:
            for i in range(3):
                first, result = threading.Event(), {}
                body = {"prompt": f"A long story {i}", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
                stream_in_thread(s.url, body, first, result)
                assert first.wait(60) and "error" not in result, result
        killed = time.monotonic()
        s.proc.kill()
        while left := [p for p in ranks if alive(p)]:
            assert time.monotonic() - killed < 2, f"ranks {left} still running 2 s after the server was killed"
            time.sleep(0.02)
        print(f"{'busy' if busy else 'idle'} ranks gone {time.monotonic() - killed:.2f} s after the server was killed")


# ---------------------------------------------------------------------------- a rank stalls
def health_message(c: httpx.Client) -> str | None:
    """None for /health 200, else its 503's message."""
    resp = c.get("/health")
    return None if resp.status_code == 200 else check_envelope(resp, 503)["message"]


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until condition() is true (polled every 20 ms); fails after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not {what} after {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("busy", [True, False], ids=["mid-stream", "idle"])
def test_a_stalled_rank_is_reported_and_the_server_recovers_when_it_moves_again(tiny_cache, tmp_path, busy):
    """SIGSTOP of one rank (mid-stream, or idle): after --rank-stall-timeout /health is a 503 naming that
    rank alone and new requests get a 503 at once; after SIGCONT /health is 200 again, the stream in
    flight runs to its end with every token, and new requests are served."""
    timeout_s = 2.0
    with ep_serve(tiny_cache, tmp_path / "ep-serve.log", "--enable-expert-parallel", "--data-parallel-size", "2",
                  "--rank-stall-timeout", str(timeout_s)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        ranks = s.ranks()
        assert len(ranks) == 2, ranks
        body = {"prompt": "Stalls happen", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        alone = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        victim = ranks[1] if busy else ranks[0]
        stream, first, streamed = None, threading.Event(), {}
        if busy:
            stream = stream_in_thread(s.url, body, first, streamed)
            assert first.wait(60) and "error" not in streamed, streamed
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        try:
            took = wait_for(lambda: health_message(c) is not None, timeout_s + 3, "/health 503")
            message = health_message(c)
            assert message.startswith("engine is stalled: engine rank(s) [") and f"(pid [{victim}])" in message, \
                message
            assert took >= timeout_s - 0.1, f"/health said 503 after {took:.2f} s, before the stall timeout"
            start = time.monotonic()
            refused = c.post("/v1/completions", json={"prompt": "new", "max_tokens": 2})
            assert "engine is stalled" in check_envelope(refused, 503)["message"]
            assert time.monotonic() - start < 1
            no_traceback(message)
        finally:
            os.kill(victim, signal.SIGCONT)
        back = wait_for(lambda: health_message(c) is None, 5, "/health 200 after SIGCONT")
        if stream is not None:
            stream.join(60)
            events = streamed["events"]
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == alone
        again = c.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone
        print(f"stalled rank ({'mid-stream' if busy else 'idle'}): /health 503 after {took:.2f} s "
              f"(timeout {timeout_s} s), 200 again {back:.2f} s after SIGCONT; stopped "
              f"{time.monotonic() - stopped:.1f} s in all")


# ---------------------------------------------------------------------------- SIGTERM, flags
@pytest.mark.slow
def test_sigterm_drains_requests_then_stops_the_tree_and_cli_flags_work(tiny_cache, tmp_path):
    args = ["--enable-expert-parallel", "--data-parallel-size", "2", "--api-key", "sekrit",
            "--api-key-exempt-paths", "/health", "--max-num-seqs", "1", "--max-waiting-seqs", "0"]
    with ep_serve(tiny_cache, tmp_path / "ep-serve.log", *args) as s:
        assert listen_addresses(s.port) == ["0100007F"]  # 127.0.0.1 only: no other address, no IPv6
        key = {"Authorization": "Bearer sekrit"}
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/health").status_code == 200  # exempt
            check_envelope(c.get("/metrics"), 401)  # exempt by default, not with this flag
            assert c.get("/metrics", headers=key).status_code == 200
            check_envelope(c.post("/v1/completions", json={"prompt": "a"}), 401)

            # One running sequence per rank and none waiting: two streams fill the server, a third is a 503.
            ranks = s.ranks()
            streams = []
            for i in range(2):
                first, result = threading.Event(), {}
                body = {"prompt": f"Expert parallelism keeps {i}", "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True}
                streams.append((stream_in_thread(s.url, body, first, result, key), first, result))
            for _, first, result in streams:
                assert first.wait(60) and "error" not in result, result
            busy = c.post("/v1/completions", headers=key, json={"prompt": "one more", "max_tokens": 2})
            check_envelope(busy, 503)
            assert busy.headers["retry-after"] == "1"

        # SIGTERM with both streams in flight: they are served to the end, then everything stops.
        tree = descendants(s.proc.pid)
        rc, took = s.stop()
        for thread, _, result in streams:
            thread.join(30)
            events = result["events"]
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
            assert all("error" not in e for e in events[:-1])
        assert rc == 0, f"exit status {rc}:\n{s.log.read_text()[-3000:]}"
        assert not [p for p in ranks if alive(p)], "a rank outlived the server"
        deadline = time.monotonic() + 5
        while [p for p in tree if alive(p)]:
            assert time.monotonic() < deadline, f"left running: {[p for p in tree if alive(p)]}"
            time.sleep(0.05)
        print(f"SIGTERM with 2 streams in flight: both finished, exit status {rc} after {took:.2f} s")


# ---------------------------------------------------------------------------- a rank raises
def test_a_rank_that_raises_fails_requests_without_showing_its_traceback():
    state = make_server_state(fake_config(model="fake", loader="reliability_fakes"), start_timeout_s=60)
    try:
        with http_server(state) as url, httpx.Client(base_url=url, timeout=30) as c:
            first, streamed = threading.Event(), {}
            body = {"prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            stream = stream_in_thread(url, body, first, streamed)
            assert first.wait(30)
            poisoned = c.post("/v1/completions", json={"prompt": [1, POISON], "max_tokens": 2})
            err = check_envelope(poisoned, 503)
            assert "RuntimeError: a poisoned batch" in err["message"], err
            stream.join(30)
            assert streamed["events"][-1] == "[DONE]" and streamed["events"][-2]["error"]["code"] == 503
            health = check_envelope(c.get("/health"), 503)
            # Unauthenticated: which rank and how, but no exception text.
            assert health["message"] == "engine is dead: engine rank 0 failed", health
            for text in (poisoned.text, str(streamed["events"][-2]), str(health)):
                no_traceback(text)
    finally:
        state.coordinator.shutdown()
