"""``serve --record-trace`` and ``tokenmill tune`` end to end on the demo model.

A real server records real traffic; a tiny tune replays that recording against two real
candidates and writes the command, the YAML, the JSON and the HTML. Nothing asserts a
timing: the SLA is loose enough for any machine, and the decision logic itself is tested on
recorded figures in test_search.py.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests.entrypoints.conftest import start_server
from tokenmill.entrypoints.cli import main
from tokenmill.tune.trace import load_trace

pytestmark = pytest.mark.slow

PROMPTS = ["the cat sat on the mat " * 3, "a b c d", "the cat sat on the mat " * 3, "hello world"]


def _record(tmp_path, *flags: str) -> list[dict]:
    path = tmp_path / "recorded.jsonl"
    server = start_server(tmp_path, "--record-trace", str(path), *flags, api_key=None)
    try:
        client = server.openai()
        usages = []
        for i, prompt in enumerate(PROMPTS):
            out = client.completions.create(
                model="demo", prompt=prompt, max_tokens=3 + i, temperature=0
            )
            usages.append(out.usage)
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        list(stream)
    finally:
        server.process.terminate()
        server.process.wait(timeout=60)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["input_length"] for x in lines[:4]] == [u.prompt_tokens for u in usages]
    assert [x["output_length"] for x in lines[:4]] == [u.completion_tokens for u in usages]
    return lines


def test_record_trace_writes_shapes_not_prompts_and_tune_replays_it(tmp_path) -> None:
    lines = _record(tmp_path)
    assert len(lines) == 5
    assert not any("prompt" in x or "messages" in x for x in lines)
    assert lines[0]["hash_ids"] == lines[2]["hash_ids"] != lines[1]["hash_ids"]
    assert [x["timestamp"] for x in lines] == sorted(x["timestamp"] for x in lines)

    out = tmp_path / "tune"
    argv = [
        "tune", "demo", "--workload", str(tmp_path / "recorded.jsonl"),
        "--sla", "ttft_p95_ms=600000,tpot_p95_ms=600000",
        "--options", "max_num_seqs", "--max-candidates", "2", "--num-finalists", "2",
        "--budget-s", "900", "--output-dir", str(out), "--no-progress", "--time-scale", "0.5",
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["num_trace_requests"] == 5
    winner = result["decision"]["winner"]
    assert winner in {"default", "max_num_seqs=4"} and result["decision"]["meets_sla"]
    statuses = {c["key"]: c["status"] for c in result["candidates"]}
    assert statuses[winner] == "winner"
    assert all(len(c["runs"]) >= 3 for c in result["candidates"])  # full rounds for finalists
    command = (out / "serve_command.txt").read_text()
    assert command.startswith("tokenmill serve demo --max-model-len")
    assert yaml.safe_load((out / "config.yaml").read_text())["model"] == "demo"
    html = (out / "report.html").read_text()
    assert winner in html and "goodput_vs_ttft.png" in html
    assert (out / "goodput_vs_ttft.png").stat().st_size > 0

    # a second run resumes: nothing is measured again
    before = {c["key"]: c["runs"] for c in result["candidates"]}
    assert main(argv) == 0
    after = {
        c["key"]: c["runs"] for c in json.loads((out / "result.json").read_text())["candidates"]
    }
    assert after == before


def test_record_trace_prompts_only_when_asked(tmp_path) -> None:
    lines = _record(tmp_path, "--record-trace-prompts")
    assert lines[1]["prompt"] == "a b c d"
    assert lines[4]["messages"] == [{"role": "user", "content": "hi"}]
    assert load_trace(str(tmp_path / "recorded.jsonl")).requests[1].prompt == "a b c d"


def test_tune_refuses_a_bad_trace_with_its_line_number(tmp_path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2}\n{"timestamp": 1}\n')
    code = main(
        [
            "tune",
            "demo",
            "--workload",
            str(path),
            "--sla",
            "ttft_p95_ms=800",
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_the_plan_sizes_static_slots_as_the_cpu_server_reserves_them() -> None:
    """On a CPU host the tune's plan uses the server's own CPU KV budget (not a GPU's of the
    same --memory) and every --max-num-seqs slot static reserves, so a static candidate the
    server would refuse to start is pruned, with the server's own reason, before it runs."""
    from tokenmill.entrypoints.tune import _plan_fn
    from tokenmill.tune.candidates import Candidate

    plan = _plan_fn("demo", 2048, 8, 256 * 2**20, 512)
    fits, _, why = plan(Candidate((("kv_cache", "static"),)))  # 256 slots of 2048 tokens
    assert not fits and "256 slots x 2048 tokens" in why
    fits, _, _ = plan(Candidate((("kv_cache", "static"), ("max_num_seqs", 4))))
    assert fits
    assert plan(Candidate())[0]  # paged: blocks on demand


def test_paged_fits_a_trace_whose_requests_would_not_all_fit_the_pool_at_once() -> None:
    """A paged candidate is pruned only where the engine could not start (no room for its
    pool), not where the trace's requests, all at once, would want more KV than the pool
    holds: they queue or are preempted, which the replay measures. Its planned memory is the
    weights plus the smaller of that demand and the pool."""
    from tokenmill.entrypoints.plan import PlanInputs, build_plan
    from tokenmill.entrypoints.tune import _plan_fn
    from tokenmill.tune.candidates import Candidate

    memory = 256 * 2**20
    plan = _plan_fn("demo", 2048, 100_000, memory, 1024)
    fits, need, why = plan(Candidate())
    whole = build_plan(
        PlanInputs(
            model="demo",
            max_model_len=2048,
            concurrency=256,
            device="cpu",
            memory_bytes=memory,
            mean_seq_len=1024,
        )
    )
    assert not whole.fits_expected  # 256 x 1,024 tokens at once overflow the pool...
    assert fits, why  # ...and the candidate still runs
    assert need == whole.weight_bytes + whole.kv_pool_bytes
    fits, need_small, _ = _plan_fn("demo", 2048, 2, memory, 64)(Candidate())
    assert fits and need_small < need
    assert not _plan_fn("demo", 2048, 8, 2**10, 512)(Candidate())[0]  # no room for the weights


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_sigterm_stops_the_candidates_server(tmp_path, when: str) -> None:
    """``kill`` of a running tune (SIGTERM) stops the ``tokenmill serve`` it started, as
    Ctrl-C does, whether the server is still starting or already serving the replay: it used
    to end at once and leave the server running, holding a port and the cores the next
    measurement runs on."""
    tune = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "tune", "demo",
         "--workload", "random:n=400,in=16-32,out=64-128,rate=2", "--sla", "ttft_p95_ms=100000",
         "--options", "max_num_seqs", "--output-dir", str(tmp_path / "o"), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        servers: list[psutil.Process] = []
        deadline = time.monotonic() + 300
        while not servers and tune.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                servers = [
                    p
                    for p in psutil.Process(tune.pid).children(recursive=True)
                    if "serve" in p.cmdline()
                ]
            time.sleep(0.1)
        assert servers, "tune started no server"
        # The deadlines bound a wait for an event (a server process, its listening socket);
        # nothing is asserted about how soon it comes.
        listening = False
        while when == "serving" and not listening and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                server = servers[0]
                listing = (
                    getattr(server, "net_connections", None) or server.connections
                )  # psutil < 6
                listening = any(c.status == psutil.CONN_LISTEN for c in listing())
            time.sleep(0.1)
        assert listening or when == "starting", "the server never listened"
        tune.send_signal(signal.SIGTERM)
        assert tune.wait(timeout=120) == 130
        _gone, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"servers left running: {[p.pid for p in alive]}"
        assert (tmp_path / "o" / "result.json").is_file()
    finally:
        if tune.poll() is None:
            tune.kill()
