"""Every metric name ``deploy/``'s alert rules and dashboard use is served on ``/metrics``."""

from __future__ import annotations

import httpx
import openai

from tests.deploy.test_alert_rules import dashboard_metric_names, rule_metric_names
from tests.entrypoints.conftest import ServerHandle

_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def served_metric_names(text: str) -> set[str]:
    """Sample names a scrape can return, from the ``# TYPE`` lines (so series not yet
    observed count) and the samples themselves."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def test_rule_and_dashboard_metrics_exist_on_a_live_server(
    server: ServerHandle, client: openai.OpenAI
) -> None:
    client.completions.create(model="demo", prompt="alert me", max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers(), timeout=10).text
    served = served_metric_names(text)
    used = rule_metric_names() | dashboard_metric_names()
    assert "tokenmill:time_to_first_token_seconds_bucket" in used
    missing = used - served
    assert not missing, f"used by deploy/ but not served on /metrics: {sorted(missing)}"
    assert (
        'tokenmill:http_responses_total{model_name="demo",path="/v1/completions",status="200"}'
        in text
    )
    assert 'tokenmill:engine_dead{model_name="demo"} 0.0' in text
    assert 'tokenmill:startup_seconds{compile_cache="none",model_name="demo"}' in text
