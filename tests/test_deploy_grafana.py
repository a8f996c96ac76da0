"""deploy/grafana/: the dashboard's structure (variables, panels, grid, data source), that it has the
panels the issue asks for, that promtool parses every query, and the provisioning files that load it.
That each metric it queries exists in a live server is tests/test_deploy_live.py's job."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    GRAFANA_VARS,
    PENDING_METRICS,
    dashboard,
    dashboard_exprs,
    metric_names,
    panels,
    substitute,
    tool,
)

PROVISIONING = DEPLOY / "grafana" / "provisioning"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_VAR = re.compile(r"\$(\w+)")


def test_variables_model_rank_layer_over_a_chosen_prometheus():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model, rank, layer = variables["model"], variables["rank"], variables["layer"]
    assert "model_name)" in model["definition"] and not model["multi"]
    assert "engine)" in rank["definition"] and rank["multi"] and rank["allValue"] == ".*"
    assert "layer)" in layer["definition"] and layer["multi"] and layer["allValue"] == ".*"
    for v in (model, rank, layer):
        assert v["datasource"] == DATASOURCE and v["query"]["query"] == v["definition"]


def test_panels_are_well_formed():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    cells: dict[tuple[int, int], str] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    defined = {v["name"] for v in board["templating"]["list"]} | {"__rate_interval", "__range"}
    for p in panels(board):
        assert p["datasource"] == DATASOURCE and p["targets"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), p["title"]
            assert set(_VAR.findall(t["expr"])) <= defined, (p["title"], t["expr"])
            assert 'model_name="$model"' in t["expr"], (p["title"], "not filtered by the model variable")


def test_the_panels_the_issue_asks_for():
    exprs = dashboard_exprs()
    joined = "\n".join(e for _, e in exprs)

    def quantiles(metric: str) -> set[str]:
        return {q for q in ("0.5", "0.9", "0.99") for _, e in exprs
                if f"histogram_quantile({q}," in e and f"{metric}_bucket" in e}

    for metric in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds"):
        assert quantiles(metric) == {"0.5", "0.9", "0.99"}, metric
    for metric in ("ep_layer:dispatch_latency_seconds", "ep_layer:combine_latency_seconds"):
        assert quantiles(metric) == {"0.5", "0.99"}, metric
        per_rank = [e for _, e in exprs if f"{metric}_bucket" in e]
        assert all("sum by (engine, le)" in e for e in per_rank), (metric, "p50 / p99 per engine")
    for needed in ("rate(vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "ep_layer:dispatch_wait_seconds_total",
                   "ep_layer:combine_wait_seconds_total", "sum by (src_rank)", "ep_layer:expert_tokens_total",
                   "ep_layer:dispatch_latency_seconds_bucket", "ep_layer:combine_latency_seconds_bucket"):
        assert needed in joined, needed
    assert 'engine=~"$rank"' in joined and 'layer=~"$layer"' in joined


def test_pending_metrics_only_in_panels_marked_so():
    for title, expr in dashboard_exprs():
        pending = metric_names(expr) & PENDING_METRICS
        marked = "not exported yet" in title
        assert bool(pending) == marked, f"{title!r}: queries {sorted(pending)}, marked pending: {marked}"


@pytest.mark.skipif(tool("promtool") is None, reason="promtool not found (apt-get install prometheus)")
def test_promtool_parses_every_query(tmp_path):
    """Each query (variables substituted) as a recording rule: promtool rejects bad PromQL."""
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(e)} for i, (_, e) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert GRAFANA_VARS["$model"] in path.read_text()


def test_provisioning_loads_the_dashboard_from_prometheus():
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "ep-layer.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"
