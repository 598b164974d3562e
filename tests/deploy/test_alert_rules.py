"""``deploy/``: the alert rules pass Prometheus' own checks and unit tests, and the dashboard
shows the metrics the rules alert on.

``promtool`` comes with Debian's ``prometheus`` package (``.ci/run`` installs it); without
it the promtool tests are skipped, saying how to get it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "tokenmill-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tokenmill-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "tokenmill-dashboard.json"
METRIC_NAME = re.compile(r"\btokenmill:[A-Za-z0-9_:]+")

ALERTS = {
    "TokenmillKVCacheUsageHigh",
    "TokenmillKVCacheFull",
    "TokenmillRequestsWaiting",
    "TokenmillQueueTimeHigh",
    "TokenmillPreemptionRateHigh",
    "TokenmillTTFTP95OverSLA",
    "TokenmillTPOTP95OverSLA",
    "TokenmillErrorRateHigh",
    "TokenmillRateLimitedHigh",
    "TokenmillEngineDead",
    "TokenmillTargetDown",
}
"""What an operator must be alerted on: KV usage, waiting and queue time, TTFT/TPOT SLAs, error
and 429 rates, engine dead, preemption rate."""


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not found: install Debian's prometheus package "
            "(apt-get install -y --no-install-recommends prometheus) to check deploy/ rules"
        )
    return path


def _rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def rule_metric_names() -> set[str]:
    """Every ``tokenmill:`` metric name the alert rules query."""
    return {name for rule in _rules() for name in METRIC_NAME.findall(rule["expr"])}


def dashboard_metric_names() -> set[str]:
    """Every ``tokenmill:`` metric name the dashboard's panels and variables query."""
    return set(METRIC_NAME.findall(DASHBOARD.read_text()))


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULE_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_there_and_unit_tested() -> None:
    alerts = {rule["alert"] for rule in _rules()}
    assert alerts == ALERTS
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == ALERTS, "every alert has a unit test where it fires"
    for rule in _rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_thresholds_are_documented() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for alert in ALERTS:
        assert f"`{alert}`" in readme, f"{alert} is not in deploy/README.md's threshold table"


def test_dashboard_shows_what_the_rules_alert_on() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    missing = rule_metric_names() - dashboard_metric_names()
    assert not missing, f"alerted on but not on the dashboard: {sorted(missing)}"
