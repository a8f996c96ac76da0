"""Shared by the deploy tests: where deploy/ and docker/ files are, the PromQL the dashboard and the
alert rules run (and the metric names in it), tools that may be missing, and `ep-serve` as a process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ep-layer.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
HOST = "127.0.0.1"

# Metrics the dashboard queries that ep-serve does not export yet (none now); only panels whose title
# says "not exported yet" may query them (tests/test_deploy_grafana.py).
PENDING_METRICS: frozenset[str] = frozenset()
# Series Prometheus makes itself, not ep-serve.
SYNTHETIC_METRICS = frozenset({"up"})
# What the dashboard's variables stand for when its queries run outside Grafana.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$model": "ep-layer-tiny", "$rank": ".*", "$layer": ".*"}

_OURS = re.compile(r"(?<![\w:])(?:vllm|ep_layer):[A-Za-z0-9_:]+")  # only metric names have colons
_UP = re.compile(r"(?<![\w:])up\s*\{")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel but rows, including those nested in collapsed rows."""
    out = []
    for p in board["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def dashboard_exprs(board: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard, variables left in."""
    return [(p["title"], t["expr"]) for p in panels(board or dashboard()) for t in p.get("targets", [])]


def variable_queries(board: dict | None = None) -> list[str]:
    """The queries behind the dashboard's query variables (label_values(...))."""
    return [v["definition"] for v in (board or dashboard())["templating"]["list"] if v["type"] == "query"]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def substitute(expr: str) -> str:
    """A dashboard query as Prometheus runs it for one model, all ranks and layers."""
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (ours are prefixed vllm: or ep_layer:, plus `up`)."""
    return set(_OURS.findall(expr)) | ({"up"} if _UP.search(expr) else set())


def tool(name: str) -> str | None:
    """An executable from PATH or from this Python's bin directory (a venv's console scripts)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# ---------------------------------------------------------------------------- ep-serve as a process
class EPServe:
    """ep-serve on HOST (`command`: `python -m serving.cli` unless given, e.g. scripts/serve.sh); output goes
    to a log file. It binds a port the OS picks (--port 0) and logs it: a port picked here and closed could
    be taken (by a rank's rendezvous, another server) before ep-serve binds it. url and port are known once
    wait_healthy returns."""

    def __init__(self, args: list[str], cache: str | os.PathLike[str], log: Path,
                 command: list[str] | None = None) -> None:
        self.log = log
        self.port: int | None = None
        self.url: str | None = None
        env = {**os.environ, "EP_LAYER_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
        command = command or [sys.executable, "-m", "serving.cli"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*command, "--port", "0", "--log-level", "info", *args], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def logged(self, pattern: str, timeout_s: float = 90.0) -> re.Match[str]:
        """The first match of `pattern` in the log, waiting until ep-serve has written it."""
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(pattern, self.log.read_text())):
            assert self.proc.poll() is None, f"ep-serve exited ({self.proc.returncode}):\n{self.log.read_text()}"
            assert time.monotonic() < deadline, \
                f"ep-serve: no {pattern!r} in its log after {timeout_s:.0f} s:\n{self.log.read_text()}"
            time.sleep(0.2)
        return match

    def rendezvous_port(self) -> int:
        """Where the job's ranks meet, as the rank-0 host logs it (once its store is bound)."""
        return int(self.logged(r"all ranks meet at \S+:(\d+)")[1])

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        """Wait until ep-serve listens (once its ranks are ready), then check that /health says 200."""
        self.port = int(self.logged(r"Uvicorn running on http://\S+:(\d+)", timeout_s)[1])
        self.url = f"http://{HOST}:{self.port}"
        health = httpx.get(f"{self.url}/health", timeout=10)
        assert health.status_code == 200, f"/health: {health.status_code} {health.text}\n{self.log.read_text()}"

    def kill(self) -> None:
        """SIGKILL the server and its engine ranks at once, as a lost host."""
        for pid in [*_children(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _children(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


@contextlib.contextmanager
def ep_serve(args: list[str], cache: str | os.PathLike[str], log: Path,
             command: list[str] | None = None) -> Iterator[EPServe]:
    server = EPServe(args, cache, log, command)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics as {sample name: [(labels, value)]}, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200, resp.text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for ls, v in samples.get(name, []) if all(ls.get(k) == w for k, w in labels.items()))
