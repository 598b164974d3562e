"""``tokenmill tune --compare``: the trace replayed against other running endpoints, each
reported beside the winner in result.json, report.html and the terminal; an endpoint that
cannot be reached is reported as failed and the rest is kept. Nothing asserts a timing: the
SLA is loose enough for any machine."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import OTHER_KEY, free_port, start_server
from tokenmill.entrypoints.cli import main

WORKLOAD = "random:n=4,in=8-16,out=2-4,rate=20"
SLA = "ttft_p95_ms=600000,tpot_p95_ms=600000"


@pytest.mark.slow
def test_compare_reports_each_endpoint_beside_the_winner(tmp_path, capsys) -> None:
    other = start_server(tmp_path, api_key=OTHER_KEY)  # the second endpoint, with a key
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = tmp_path / "tune"
    argv = [
        "tune", "demo", "--workload", WORKLOAD, "--sla", SLA,
        "--options", "max_num_seqs", "--max-candidates", "1", "--num-finalists", "1",
        "--budget-s", "600", "--output-dir", str(out), "--no-progress",
        "--compare", other.base_url, dead,
        "--compare-api-key", OTHER_KEY, "--compare-ready-timeout-s", "1",
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        other.stop()
    result = json.loads((out / "result.json").read_text())
    winner = result["decision"]["winner"]
    assert winner == "default" and result["decision"]["meets_sla"]

    beside = result["compare_winner"]
    assert beside["key"] == winner and beside["num_rounds"] >= 3
    assert beside["measured_on_requests"] == 4 and beside["request_goodput"] > 0
    assert [c["url"] for c in result["compare"]] == [other.base_url, dead]
    reached, down = result["compare"]
    assert reached["model_id"] == "demo"  # its /v1/models answered, with the key
    assert reached["completed"] == 4 and reached["failed"] == 0
    assert reached["request_goodput"] > 0 and reached["p95_ttft_ms"] is not None
    assert reached["meets_sla"] and reached["sla_misses"] == []
    assert down["error"].startswith(f"cannot reach {dead}") and "completed" not in down

    html = (out / "report.html").read_text()
    table = html.split("<h2>Other endpoints, same trace</h2>")[1].split("</table>")[0]
    rows = table.split("<tr>")[2:]  # after the header row
    assert len(rows) == 3
    assert rows[0].startswith(f"<td>winner: {winner} (mean of {beside['num_rounds']} replays)")
    assert rows[1].startswith(f"<td>{other.base_url}</td>") and "<td>meets</td>" in rows[1]
    assert rows[2].startswith(f"<td>{dead}</td>") and "failed: cannot reach" in rows[2]

    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("compare: ")]
    assert lines[0].startswith(f"compare: winner {winner}: goodput ")
    assert lines[1].startswith(f"compare: {other.base_url}: goodput ")
    assert lines[1].endswith("meets the SLA")
    assert lines[2].startswith(f"compare: {dead}: failed: cannot reach")


def test_a_compare_value_that_is_no_url_is_refused_before_the_search(tmp_path, capsys) -> None:
    argv = ["tune", "demo", "--workload", WORKLOAD, "--sla", SLA, "--output-dir", str(tmp_path)]
    assert main([*argv, "--compare", "127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "--compare 127.0.0.1:8000: not an http(s) URL" in err
    assert not (tmp_path / "result.json").exists()
