"""Prometheus text parsing and the figures read from it."""

from __future__ import annotations

import asyncio

import httpx

from tokenmill.bench.server_metrics import MetricsScraper, parse_prometheus_text, read_figures

TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a b {c}"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="x\\"y"} 0.5
vllm:num_preemptions_total{engine="0"} 3
vllm:num_preemptions_total{engine="1"} 4
process_resident_memory_bytes 2.5e+08
broken_line_without_value
weird{unclosed="x 1
"""


def test_parse_handles_labels_comments_and_garbage() -> None:
    samples = parse_prometheus_text(TEXT)
    assert samples["vllm:kv_cache_usage_perc"] == [0.25, 0.5]
    assert samples["process_resident_memory_bytes"] == [2.5e8]
    assert "broken_line_without_value" not in samples and "weird" not in samples


def test_figures_take_max_of_gauges_and_sum_of_counters() -> None:
    figures = read_figures(parse_prometheus_text(TEXT))
    assert figures["kv_cache_usage"] == 0.5
    assert figures["num_preemptions"] == 7
    assert figures["resident_memory_bytes"] == 2.5e8
    assert figures["num_requests_running"] is None


def test_tokenmill_names_win_over_vllm_names() -> None:
    figures = read_figures(parse_prometheus_text(TEXT + "tokenmill:kv_cache_usage_perc 0.9\n"))
    assert figures["kv_cache_usage"] == 0.9


def test_start_up_costs_are_read_with_their_compile_cache_state() -> None:
    from tokenmill.bench.offline import _compile_cell
    from tokenmill.bench.server_metrics import read_startup_costs
    from tokenmill.core.stats import EngineStats, StartupCosts
    from tokenmill.metrics import ServerMetrics
    from tokenmill.metrics.ops import install_ops_metrics

    metrics = ServerMetrics("m", 1024, lambda: EngineStats())
    costs = StartupCosts(2.0, 0.5, {1: 4.0, 8: 1.0}, {1: "warm", 8: "warm"}, 8.0)
    install_ops_metrics(metrics, is_dead=lambda: False, read_startup=lambda: costs)
    read = read_startup_costs(metrics.render().decode())
    assert read == {
        "startup_s": 8.0,
        "model_load_s": 2.0,
        "kv_allocation_s": 0.5,
        "compile_cache": "warm",
        "compile_s": 5.0,
        "compile_s_by_bucket": {"1": 4.0, "8": 1.0},
    }
    assert read_startup_costs("vllm:num_requests_running 1.0\n") is None
    assert _compile_cell(12.34, "cold") == "12.3 cold" and _compile_cell(0.0, "none") == "0.0"


def test_spec_decode_counters_are_exported_and_read_back() -> None:
    """The engine's speculation counters reach /metrics with vLLM's names (tokenmill's
    prefix), and the bench turns their deltas into acceptance rate and mean length."""
    from tokenmill.bench.server_metrics import spec_decode_figures
    from tokenmill.core.stats import EngineStats
    from tokenmill.metrics import ServerMetrics

    stats = EngineStats()
    stats.record_speculation(3, 2)
    stats.record_speculation(3, 0)
    stats.record_speculation(2, 1)
    metrics = ServerMetrics("demo", 1024, lambda: stats)
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "demo"}
    assert sample("tokenmill:spec_decode_num_drafts_total", labels) == 3
    assert sample("tokenmill:spec_decode_num_draft_tokens_total", labels) == 8
    assert sample("tokenmill:spec_decode_num_accepted_tokens_total", labels) == 3
    per_pos = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"
    assert [sample(per_pos, {**labels, "position": str(p)}) for p in range(3)] == [2, 1, 0]
    after = read_figures(parse_prometheus_text(metrics.render().decode()))
    before = {"spec_num_drafts": 1.0, "spec_num_draft_tokens": 2.0, "spec_num_accepted_tokens": 1.0}
    figures = spec_decode_figures(before, after)
    assert figures["spec_acceptance_rate"] == 2 / 6
    assert figures["spec_mean_accepted_length"] == 1 + 2 / 2
    assert spec_decode_figures({}, read_figures({}))["spec_mean_accepted_length"] is None


def test_sum_by_label_sums_each_label_value_and_the_unlabelled_aggregate() -> None:
    from tokenmill.bench.server_metrics import sum_by_label

    text = (
        "# TYPE x_total counter\n"
        'x_total{model_name="m",replica="0"} 3.0\n'
        'x_total{model_name="m",replica="1"} 5.0\n'
        'x_total{model_name="m",replica="1",kind="b"} 1.0\n'
        'x_total{model_name="m"} 9.0\n'
        'y_total{replica="0"} 7.0\n'
    )
    assert sum_by_label(text, "x_total", "replica") == {"0": 3.0, "1": 6.0, "": 9.0}
    assert sum_by_label(text, "z_total", "replica") == {}


def _exposition(kv_usage: float, preemptions: int, running: int) -> str:
    return (
        f"tokenmill:kv_cache_usage_perc {kv_usage}\n"
        f"tokenmill:num_preemptions_total {preemptions}\n"
        f"tokenmill:num_requests_running {running}\n"
    )


def test_scraper_keeps_the_peak_of_gauges_and_the_delta_of_counters_across_scrapes() -> None:
    """The peak is the highest scrape, not the last; preemptions count from the first scrape."""
    pages = iter(
        [_exposition(0.0, 5, 0), _exposition(0.75, 5, 3), _exposition(0.25, 7, 1)]
        + [_exposition(0.0, 7, 0)]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=next(pages))

    async def run() -> dict[str, object]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(client, "http://server/metrics", interval_s=3600)
            await scraper.start()  # the 'before' scrape; the poller sleeps the whole test
            await scraper.scrape()
            await scraper.scrape()
            await scraper.stop()  # the 'after' scrape
            return scraper.report()

    report = asyncio.run(run())
    assert report["available"] is True and report["num_scrapes"] == 4
    assert report["peak_kv_cache_usage"] == 0.75
    assert report["peak_num_requests_running"] == 3
    assert report["num_preemptions"] == 2


def test_scraper_of_a_target_without_metrics_reports_unavailable() -> None:
    async def run() -> dict[str, object]:
        transport = httpx.MockTransport(lambda request: httpx.Response(404))
        async with httpx.AsyncClient(transport=transport) as client:
            scraper = MetricsScraper(client, "http://server/metrics")
            await scraper.start()
            await scraper.stop()
            return scraper.report()

    assert asyncio.run(run()) == {"available": False}
