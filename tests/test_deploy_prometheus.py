"""deploy/prometheus/: promtool checks the scrape config and the alert rules and runs their unit tests
(alerts_test.yml); every alert is tested, carries a severity and says what happened. promtool comes
with Debian's prometheus package (.ci/run installs it); without it those checks skip."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from deploy_helpers import ALERTS, DEPLOY, alert_rules, tool

PROMETHEUS_DIR = DEPLOY / "prometheus"
PROMTOOL = tool("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found (apt-get install prometheus)")
# What the issue asks the alerts to cover, by alert name.
REQUIRED_ALERTS = {"EPServeDown", "EPServeHighTTFT", "EPServeHighTPOT", "EPServeRequestsWaiting",
                   "EPExpertLoadImbalance", "EPDispatchWaitSpike", "EPCombineWaitSpike", "EPDispatchLatencyP99Spike",
                   "EPCombineLatencyP99Spike"}


def promtool(*args: str) -> str:
    out = subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert f"SUCCESS: {len(alert_rules())} rules found" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_promtool_alert_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_scrape_config_loads_the_rules_and_scrapes_ep_serve():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == [ALERTS.name]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "ep-serve" and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["ep-serve:8000"]}]  # the compose service and its port


def test_every_alert_is_unit_tested_and_described():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names) and set(names) >= REQUIRED_ALERTS
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    assert tests["rule_files"] == [ALERTS.name]
    fired = {case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", [])
             if case.get("exp_alerts")}
    assert fired == set(names), f"alerts without a unit test that fires them: {set(names) - fired}"
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"].keys() == {"summary", "description"}, rule["alert"]
        assert rule.get("for"), f"{rule['alert']}: no `for`, a single bad scrape would page"
