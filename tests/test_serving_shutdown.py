"""SIGTERM with requests in flight, on `ep-serve` itself (the built-in tiny DeepSeek-V3, a subprocess):
new connections stop at once, a request that finishes within the grace (server.SHUTDOWN_GRACE_S) is
served to its end, and those still running then end with a 503 "the server is shutting down": a
stream (completions and chat alike) with that error event followed by `data: [DONE]`, a plain request
with the error envelope. No traceback in the log, exit status 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from deploy_helpers import EPServe
from test_serving_api import check_envelope, sse_events

from serving.api.server import SHUTDOWN_FLUSH_S, SHUTDOWN_GRACE_S, SHUTTING_DOWN

LONG = 1980  # tokens (the tiny model holds 2048 with the prompt): they outlast the grace on a CPU, checked below
RATE_WINDOW_S = 2.0  # how long the test watches a stream to learn how fast this machine makes tokens
MESSAGES = [{"role": "user", "content": "Once upon a time there was a small model."}]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> str:
    from serving.tiny_model import tiny_checkpoint

    cache = str(tmp_path_factory.mktemp("tiny-cache"))
    tiny_checkpoint(cache)  # written before the server starts
    return cache


class Call(threading.Thread):
    """One request from a thread: a stream's events as they come (`first` set at the first content),
    or a plain response; `ended` is when it ended."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.first = threading.Event()
        self.events: list[dict | str] = []
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.ended = 0.0
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=90) as c:
                if not self.body.get("stream"):
                    self.first.set()
                    self.response = c.post(self.path, json=self.body)
                    return
                with c.stream("POST", self.path, json=self.body) as resp:
                    assert resp.status_code == 200, resp.read()
                    for line in resp.iter_lines():
                        self.events += sse_events([line])
                        if line.startswith("data: {") and ('"text": "' in line or '"content": "' in line) \
                                and '"content": ""' not in line:
                            self.first.set()
        except Exception as e:
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.first.set()


def finish_reason(event: dict | str) -> str | None:
    return event["choices"][0]["finish_reason"] if isinstance(event, dict) and event.get("choices") else None


@pytest.mark.slow
def test_sigterm_ends_streams_in_flight_with_an_error_event_then_done(tiny_cache, tmp_path):
    server = EPServe([], tiny_cache, tmp_path / "ep-serve.log")
    try:
        server.wait_healthy()
        greedy = {"temperature": 0, "ignore_eos": True}
        long_calls = [
            Call(server.url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": LONG, "stream": True,
                                                 **greedy}),
            Call(server.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LONG, "stream": True,
                                                      "stream_options": {"include_usage": True}, **greedy}),
            Call(server.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LONG, **greedy}),
        ]
        for call in long_calls:
            assert call.first.wait(60) and call.error is None, call.error
        # Tokens a stream gets per second here, with the others running: the short request must finish
        # within the grace, the long ones must not (the grace's end is theirs). The rate only falls from
        # here (each token reads all the keys before it), so what the first stream has left at SIGTERM,
        # over 1.25 times the grace at this rate, keeps the long ones running past it.
        before = len(long_calls[0].events)
        time.sleep(RATE_WINDOW_S)
        rate = (len(long_calls[0].events) - before) / RATE_WINDOW_S
        short_tokens = max(2, int(rate * SHUTDOWN_GRACE_S / 4))
        short = Call(server.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": short_tokens,
                                                          "stream": True, **greedy})
        assert short.first.wait(60) and short.error is None, short.error
        stopped = time.monotonic()
        left = LONG - len(long_calls[0].events)  # tokens the first stream still has to make
        assert rate * SHUTDOWN_GRACE_S * 1.25 < left, f"{rate:.0f} tokens/s, {left} tokens left: LONG is too short"
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(SHUTDOWN_GRACE_S + SHUTDOWN_FLUSH_S + 60)
        for call in [*long_calls, short]:
            call.join(30)
            assert not call.is_alive() and call.error is None, call.error
        log = server.log.read_text()
    finally:
        if server.proc.poll() is None:
            server.kill()

    assert rc == 0, f"exit status {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]  # nothing cancelled by uvicorn either
    # Served to its end within the grace.
    assert short.events[-1] == "[DONE]" and finish_reason(short.events[-2]) == "length", short.events[-3:]
    assert short.ended - stopped < SHUTDOWN_GRACE_S
    for call in long_calls[:2]:
        events = call.events
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2] == {"error": {"message": SHUTTING_DOWN, "type": "ServiceUnavailableError", "param": None,
                                        "code": 503}}, events[-3:]
        assert all(finish_reason(e) is None and "usage" not in e for e in events[:-2]), events[-4:]
        assert any(isinstance(e, dict) and e.get("choices") for e in events[:-2])
        assert SHUTDOWN_GRACE_S - 1 < call.ended - stopped < SHUTDOWN_GRACE_S + SHUTDOWN_FLUSH_S
    chat_events = long_calls[1].events
    assert chat_events[0]["object"] == "chat.completion.chunk"
    assert chat_events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    plain = long_calls[2].response
    assert check_envelope(plain, 503)["message"] == SHUTTING_DOWN
