"""The observability stack against a live `ep-serve` (built-in tiny model, 2 expert-parallel CPU ranks):
every metric that the Grafana dashboard and the alert rules query is in its /metrics, and a real
Prometheus server (Debian's package; skipped without it) scraping it under a bounded load answers the
TTFT and TPOT quantiles, counts exactly the requests and tokens sent, evaluates every alert rule and
every dashboard query without error. Everything runs on 127.0.0.1 and stops by itself."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from deploy_helpers import (
    ALERTS,
    DEPLOY,
    HOST,
    PENDING_METRICS,
    SYNTHETIC_METRICS,
    EPServe,
    alert_rules,
    dashboard_exprs,
    ep_serve,
    metric_names,
    scrape,
    substitute,
    tool,
    total,
    variable_queries,
)

from ep_layer.latency import BOUNDS_S
from serving.api.metrics import INTER_TOKEN_BUCKETS, TTFT_BUCKETS

MODEL = "ep-layer-tiny"
PROMPTS = ["The quick brown fox", "Expert parallelism keeps", "Hello! How are you", "def forward(self, x):",
           "Mixture of experts", "Prometheus scrapes"]
NUM_REQUESTS = 32
CONCURRENCY = 8
SCRAPE_S = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EPServe]:
    tmp = tmp_path_factory.mktemp("live")
    with ep_serve(["--enable-expert-parallel", "--data-parallel-size", "2", "--max-tokens-per-rank", "64",
                   "--max-num-seqs", "16"], tmp / "cache", tmp / "ep-serve.log") as s:
        yield s


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> tuple[int, float]:
    """(prompt tokens, seconds from sending until the client saw the first token: the first chunk of a
    stream, the whole response otherwise), so never less than the server's TTFT."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        return r.json()["usage"]["prompt_tokens"], time.monotonic() - start
    body.update(stream=True, stream_options={"include_usage": True})
    first, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            first = first if first is not None else time.monotonic() - start
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None and usage["completion_tokens"] == max_tokens, usage
    return usage["prompt_tokens"], first


def load(url: str, n: int, seed: int) -> tuple[list[int], list[int], float]:
    """n completions, CONCURRENCY at a time, half of them streamed: (max_tokens of each, prompt tokens
    of each, the longest time any client waited for its first token)."""
    rng = random.Random(seed)
    jobs = [(rng.choice(PROMPTS), rng.randint(4, 12), i % 2 == 0) for i in range(n)]

    async def run() -> list[tuple[int, float]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def gated(job: tuple[str, int, bool]) -> tuple[int, float]:
                async with gate:
                    return await _one(client, *job)
            return await asyncio.wait_for(asyncio.gather(*(gated(j) for j in jobs)), 120)

    results = asyncio.run(run())
    return [j[1] for j in jobs], [p for p, _ in results], max(t for _, t in results)


def queried_metrics() -> dict[str, set[str]]:
    """metric name -> where it is queried (dashboard panel titles, alert names, variables)."""
    where: dict[str, set[str]] = {}
    for title, expr in dashboard_exprs():
        for name in metric_names(expr):
            where.setdefault(name, set()).add(f"panel {title!r}")
    for query in variable_queries():
        for name in metric_names(query):
            where.setdefault(name, set()).add(f"variable {query!r}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            where.setdefault(name, set()).add(f"alert {rule['alert']}")
    return where


def test_every_metric_the_dashboard_and_alerts_query_is_exported(server: EPServe):
    load(server.url, 6, seed=1)  # so that histograms, step and wait counters have samples
    exported = {name for name, samples in scrape(server.url).items() if samples}
    where = queried_metrics()
    wanted = set(where) - PENDING_METRICS - SYNTHETIC_METRICS
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "ep_layer:dispatch_wait_seconds_total", "ep_layer:expert_tokens_total",
            "ep_layer:dispatch_latency_seconds_bucket", "ep_layer:combine_latency_seconds_bucket"} <= wanted  # parsing
    missing = {name: sorted(where[name]) for name in sorted(wanted - exported)}
    assert not missing, f"queried but not in /metrics: {missing}"
    assert not PENDING_METRICS & exported, "a pending metric is exported now: take it out of PENDING_METRICS"


def test_dispatch_combine_latency_counts_match_the_steps(server: EPServe):
    """Each engine step runs every MoE layer once, an empty step too: one dispatch and one combine per
    MoE layer and step, on each rank. Their latencies (host time with the reference backend) lie
    inside the steps' own host time."""
    before = scrape(server.url)
    load(server.url, 4, seed=3)
    after = scrape(server.url)
    moe_layers = {ls["layer"] for ls, _ in after["ep_layer:expert_tokens_total"]}
    assert len(moe_layers) == 2, moe_layers  # the tiny model: one dense layer, then two MoE layers

    def delta(name: str, engine: str) -> float:
        labels = {"model_name": MODEL, "engine": engine}
        return total(after, name, **labels) - total(before, name, **labels)

    for engine in ("0", "1"):
        steps = delta("ep_layer:engine_steps_total", engine)
        assert steps > 0, engine
        latency_s = 0.0
        for op in ("dispatch", "combine"):
            name = f"ep_layer:{op}_latency_seconds"
            assert delta(f"{name}_count", engine) == len(moe_layers) * steps, (op, engine, steps)
            buckets = {ls["le"]: v for ls, v in after[f"{name}_bucket"] if ls["engine"] == engine}
            assert [float(le) for le in buckets] == [*BOUNDS_S, math.inf], (op, engine)
            counts = list(buckets.values())
            assert counts == sorted(counts) and counts[-1] == total(after, f"{name}_count", engine=engine)
            latency_s += delta(f"{name}_sum", engine)
        step_s = delta("ep_layer:engine_step_seconds_total", engine)
        assert 0 < latency_s <= step_s * (1 + 1e-9), (engine, latency_s, step_s)


# ---------------------------------------------------------------------------- a real Prometheus
class Prometheus:
    """Debian's prometheus binary on a free 127.0.0.1 port (it binds port 0 and logs the port it got),
    scraping `target` every SCRAPE_S seconds with deploy/prometheus/prometheus.yml's job and alert rules."""

    def __init__(self, binary: str, target: str, tmp: Path) -> None:
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
        config["rule_files"] = [str(ALERTS)]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = ""  # once wait_ready has read the port from the log
        self.log = tmp / "prometheus.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address={HOST}:0", "--log.level=info"],
                stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def listening() -> bool:
            match = re.search(r'msg="Listening on" address=(\S+)', self.log.read_text())
            self.url = f"http://{match[1]}" if match else ""
            return bool(match)
        self.until(listening, timeout_s, "listening")
        self.until(lambda: httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200, timeout_s, "ready")

    def until(self, check, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()}"
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"prometheus: not {what} after {timeout_s:.0f} s"
            time.sleep(0.2)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        (sample,) = self.query(expr, at)
        return float(sample["value"][1])

    def scraped_after(self, t: float, timeout_s: float = 15.0) -> float:
        """Wait for a successful scrape that started after wall-clock time t; return its time."""
        stamp: list[float] = []

        def check() -> bool:
            result = self.query('up{job="ep-serve"}[10s]')  # a range: the samples with their scrape times
            if not result:
                return False
            at, up = result[0]["values"][-1]
            if float(at) > t and up == "1":
                stamp.append(float(at))
                return True
            return False
        self.until(check, timeout_s, f"scraped after {t:.1f}")
        return stamp[0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


COUNTERS = {
    "requests": 'sum(vllm:request_success_total{finished_reason="length"})',
    "all_finished": "sum(vllm:request_success_total)",
    "e2e": "sum(vllm:e2e_request_latency_seconds_count)",
    "ttft": "sum(vllm:time_to_first_token_seconds_count)",
    "itl": "sum(vllm:inter_token_latency_seconds_count)",
    "generated": "sum(vllm:generation_tokens_total)",
    "prompt": "sum(vllm:prompt_tokens_total)",
    "steps": "sum(ep_layer:engine_steps_total)",
}


def _bound(buckets: tuple[float, ...], seconds: float) -> float:
    """The upper bound of the histogram bucket that holds `seconds`: no quantile of observations
    <= seconds can be above it."""
    return next((b for b in buckets if b >= seconds), math.inf)


@pytest.mark.skipif(tool("prometheus") is None,
                    reason="prometheus not found: apt-get install prometheus (.ci/run does)")
@pytest.mark.slow
def test_prometheus_scrapes_a_live_server_under_load(server: EPServe, tmp_path: Path):
    prom = Prometheus(tool("prometheus"), server.url.removeprefix("http://"), tmp_path)
    try:
        prom.wait_ready()
        before_at = prom.scraped_after(time.time())
        before = {k: prom.value(q, before_at) for k, q in COUNTERS.items()}

        start = time.time()
        max_tokens, prompt_tokens, slowest_first_token = load(server.url, NUM_REQUESTS, seed=2)
        after_at = prom.scraped_after(time.time())
        delta = {k: prom.value(q, after_at) - before[k] for k, q in COUNTERS.items()}

        assert delta["requests"] == delta["all_finished"] == delta["e2e"] == delta["ttft"] == NUM_REQUESTS, delta
        assert delta["generated"] == sum(max_tokens), delta
        assert delta["itl"] == sum(m - 1 for m in max_tokens), delta
        assert delta["prompt"] == sum(prompt_tokens), delta
        assert delta["steps"] > 0, delta

        window = f"{math.ceil(after_at - start) + 2 * SCRAPE_S}s"
        for metric, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                                ("vllm:inter_token_latency_seconds", INTER_TOKEN_BUCKETS)):
            qs = [prom.value(f"histogram_quantile({q}, sum by (le) (increase({metric}_bucket[{window}])))",
                             after_at) for q in (0.5, 0.9, 0.99)]
            # Every server-side TTFT / gap between tokens is shorter than the longest client wait.
            bound = _bound(buckets, slowest_first_token if "first_token" in metric else time.time() - start)
            assert 0 < qs[0] <= qs[1] <= qs[2] <= bound, (metric, qs, bound)
            print(f"{metric}: p50/p90/p99 = {qs} (bound {bound})")

        # Every rule loaded, and evaluated against this server's series without an error.
        never = "0001-01-01T00:00:00Z"  # Prometheus' lastEvaluation of a rule not evaluated yet
        prom.until(lambda: all(r.get("lastEvaluation", never) != never
                               for g in _rule_groups(prom) for r in g["rules"]), 10, "evaluating the rules")
        rules = {r["name"]: r for g in _rule_groups(prom) for r in g["rules"]}
        assert set(rules) == {r["alert"] for r in alert_rules()}
        assert all(r["health"] == "ok" for r in rules.values()), {n: r.get("lastError") for n, r in rules.items()}
        assert not [a for a in prom.query("ALERTS") if a["metric"]["alertname"] == "EPServeDown"]

        # Every dashboard query runs; all but the pending ones have data right after the load.
        for title, expr in dashboard_exprs():
            result = prom.query(substitute(expr), after_at)
            if not metric_names(expr) & PENDING_METRICS:
                assert result, f"{title!r}: no data for {substitute(expr)}"
    finally:
        prom.stop()


def _rule_groups(prom: Prometheus) -> list[dict]:
    return httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
