"""Work bounded before it is spent (docs/reliability.md), on `ep-serve` itself (the built-in tiny
DeepSeek-V3, 2 expert-parallel ranks, 127.0.0.1 only):

- a prompt too long for the model in any tokenization (15 MB) is refused at once on every route that
  takes one, without being tokenized;
- while 4 clients keep the server tokenizing the longest prompts it takes, the event loop answers
  /health within 100 ms (p99), a normal request takes at most twice its unloaded time, and the server's
  memory returns to within 10 % of where it started once they stop; the pool that tokenizes long texts runs
  at a lower CPU priority than the server;
- the choices of one request reach a rank in one message, their shared stop strings pickled once.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import threading
import time

import httpx
import pytest
from deploy_helpers import EPServe
from test_serving_api import check_envelope, fake_config

from serving.api.prompts import NORMALIZER_SLACK, TOKENIZE_NICE, longest_token_chars, make_tokenize_pool
from serving.engine.dp_coordinator import DPCoordinator, Submission
from serving.engine.messages import AddRequests
from serving.engine.sequence import SamplingParams

NORMAL = {"prompt": "A normal request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from serving.tiny_model import tiny_checkpoint

    cache = tmp_path_factory.mktemp("tiny-cache")
    checkpoint = tiny_checkpoint(str(cache))
    server = EPServe(["--enable-expert-parallel", "--data-parallel-size", "2"], cache,
                     tmp_path_factory.mktemp("log") / "ep-serve.log")
    try:
        server.wait_healthy()
        yield server, checkpoint
    finally:
        server.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def longest_prompt(url: str, checkpoint: str) -> str:
    """The longest text the server tokenizes for a one-token completion (one character more is refused
    unread): (max_model_len - 1) tokens of the longest token's characters, times the normalizer slack."""
    from tokenizers import Tokenizer

    max_model_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    longest = longest_token_chars(Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json")))
    words = "the quick brown fox jumps over a lazy dog "
    chars = (max_model_len - 1) * longest * NORMALIZER_SLACK
    return (words * (chars // len(words) + 1))[:chars]


def test_a_prompt_no_model_could_hold_is_refused_unread(served):
    server, checkpoint = served
    huge = "x " * (15 << 19)  # 15 MiB
    bodies = {"/v1/completions": {"prompt": huge, "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": huge}], "max_tokens": 1},
              "/tokenize": {"prompt": huge}}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path, body in bodies.items():
            start = time.monotonic()
            resp = c.post(path, json=body)
            took = time.monotonic() - start
            err = check_envelope(resp, 400)
            assert err["param"] in ("prompt", "messages") and "characters cannot fit" in err["message"], err
            assert took < 2, f"{path}: {took:.2f} s to refuse a 15 MiB prompt"  # tokenizing it took 10-20 s
        # One character fewer than the bound is tokenized (and then found too long, in tokens).
        text = longest_prompt(server.url, checkpoint)
        over = check_envelope(c.post("/v1/completions", json={"prompt": text + "x", "max_tokens": 1}), 400)
        assert "characters cannot fit" in over["message"]
        at = check_envelope(c.post("/v1/completions", json={"prompt": text, "max_tokens": 1}), 400)
        assert "maximum context length" in at["message"], at


@pytest.mark.slow
def test_the_server_keeps_answering_while_it_tokenizes_the_longest_prompts(served):
    server, checkpoint = served
    body = json.dumps({"prompt": longest_prompt(server.url, checkpoint), "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _ in range(3):  # warm: the first requests of a process take longer
            assert c.post("/v1/completions", json=NORMAL).status_code == 200
            c.post("/v1/completions", content=body, headers=headers)

        def normal_latency() -> float:
            times = []
            for _ in range(5):
                start = time.monotonic()
                assert c.post("/v1/completions", json=NORMAL).status_code == 200
                times.append(time.monotonic() - start)
            return statistics.median(times)

        unloaded = normal_latency()
        rss_start = rss_mb(server.proc.pid)
        stop, tokenized = threading.Event(), []

        def heavy() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as hc:
                while not stop.is_set():
                    resp = hc.post("/v1/completions", content=body, headers=headers)
                    assert resp.status_code == 400 and "maximum context length" in resp.text, resp.text
                    tokenized.append(1)

        clients = [threading.Thread(target=heavy, daemon=True) for _ in range(4)]
        for t in clients:
            t.start()
        health = []
        try:
            end = time.monotonic() + 6
            while time.monotonic() < end:
                start = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - start)
                time.sleep(0.02)
            loaded = normal_latency()
        finally:
            stop.set()
            for t in clients:
                t.join(60)
        time.sleep(1)
        rss_end = rss_mb(server.proc.pid)
    p99 = sorted(health)[int(0.99 * len(health))]
    print(f"{len(tokenized)} longest prompts tokenized by 4 clients; /health p99 {p99 * 1e3:.1f} ms over "
          f"{len(health)} polls; a normal request {unloaded * 1e3:.0f} ms alone, {loaded * 1e3:.0f} ms under load; "
          f"server RSS {rss_start:.0f} MB before, {rss_end:.0f} MB after")
    assert len(tokenized) >= 8, "the load did not happen"
    assert p99 < 0.1, f"/health p99 {p99 * 1e3:.0f} ms while tokenizing"
    assert loaded <= 2 * unloaded, f"a normal request took {loaded:.3f} s under load, {unloaded:.3f} s alone"
    assert rss_end <= 1.1 * rss_start, f"server RSS {rss_start:.0f} MB before the load, {rss_end:.0f} MB after"


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread CPU priorities on this platform")
def test_the_tokenizing_pool_yields_the_cpu_to_the_server():
    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pool = make_tokenize_pool()
    try:
        in_pool = pool.submit(priority).result(10)
    finally:
        pool.shutdown()
    assert in_pool == min(19, priority() + TOKENIZE_NICE), (priority(), in_pool)


def test_a_requests_choices_reach_a_rank_in_one_message_sharing_their_stop_strings(seed):
    """DPCoordinator.submit without started ranks: what each rank's inbox receives, through the pipe."""
    coordinator = DPCoordinator(fake_config(model="fake", data_parallel_size=1))
    try:
        stop = tuple(f"{seed}-{i}-" + "s" * 100 for i in range(64))
        prompt = list(range(1, 200))
        params = SamplingParams(max_tokens=4, stop=stop, seed=seed % 1000)
        subs = [Submission(f"r-{i}", prompt, SamplingParams(max_tokens=4, stop=tuple(stop), seed=seed % 1000 + i),
                           lambda out: None) for i in range(16)]
        assert coordinator.submit(subs) == [0] * 16
        message = coordinator._inboxes[0].get(timeout=10)
        assert isinstance(message, AddRequests) and [a.request_id for a in message.requests] == [s.request_id
                                                                                                 for s in subs]
        first = message.requests[0]
        for add in message.requests:
            assert add.params.stop == params.stop and add.prompt_token_ids == prompt
            assert all(a is b for a, b in zip(add.params.stop, first.params.stop))  # one copy in the rank
            assert add.prompt_token_ids is first.prompt_token_ids
        assert len(pickle.dumps(message)) < 2 * sum(map(len, stop))
    finally:
        coordinator.shutdown()
