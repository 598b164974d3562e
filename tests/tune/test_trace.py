"""Workload traces: each format read, bad lines refused by number, arrival times kept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.tune.runner import build_bench_requests
from tokenmill.tune.trace import (
    HASH_BLOCK_TOKENS,
    TraceError,
    build_synthetic_trace,
    load_jsonl_trace,
    load_trace,
    write_jsonl_trace,
)

MOONCAKE = [
    {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]},
    {"timestamp": 250, "input_length": 700, "output_length": 10, "hash_ids": [0, 2]},
    {"timestamp": 1000, "input_length": 30, "output_length": 5},
]


def _write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_mooncake_trace_keeps_lengths_hashes_and_arrival_times(tmp_path) -> None:
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps(x) for x in MOONCAKE])
    trace = load_trace(path)
    assert [r.input_length for r in trace.requests] == [600, 700, 30]
    assert trace.requests[1].hash_ids == (0, 2)
    assert trace.arrival_offsets_s() == [0.0, 0.25, 1.0]
    assert trace.arrival_offsets_s(time_scale=2.0) == [0.0, 0.5, 2.0]
    assert trace.describe()["has_hash_ids"]


def test_prompt_and_messages_lines(tmp_path) -> None:
    lines = [
        json.dumps({"timestamp": 0, "prompt": "hello there world", "output_length": 4}),
        json.dumps(
            {"timestamp": 5, "messages": [{"role": "user", "content": "hi"}], "output_length": 2}
        ),
    ]
    trace = load_jsonl_trace(_write_lines(tmp_path / "p.jsonl", lines))
    assert trace.requests[0].prompt == "hello there world"
    assert trace.requests[1].messages == ({"role": "user", "content": "hi"},)
    requests = build_bench_requests(trace, np.arange(10), round_index=1)
    assert requests[0].prompt_text == "[1] hello there world"  # rounds never share a prefix


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"input_length": 3, "output_length": 2}', "'timestamp'"),
        ('{"timestamp": 1, "input_length": -3, "output_length": 2}', "'input_length'"),
        ('{"timestamp": 1, "output_length": 2}', "needs 'input_length'"),
        ('{"timestamp": 1, "input_length": 3, "output_length": 0}', "'output_length' must be >= 1"),
        (
            '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": ["a"]}',
            "'hash_ids'",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_line_is_refused_with_its_number(tmp_path, line: str, message: str) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps(MOONCAKE[0]), "", line])
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{message}"):
        load_trace(path)


def test_sharegpt_file_gets_drawn_arrivals(tmp_path) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": "a" * 40},
                {"from": "gpt", "value": "b" * 80},
            ]
        },
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "c" * 8}, {"from": "gpt", "value": "d" * 8}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    trace = load_trace(str(path), num_requests=10, rate=2.0)
    assert [r.prompt for r in trace.requests] == ["a" * 40, "c" * 8]
    assert trace.requests[0].output_length == 20
    assert trace.requests[1].timestamp_ms > 0
    (tmp_path / "broken.json").write_text("[{]")
    with pytest.raises(TraceError, match=r"broken\.json:1"):
        load_trace(str(tmp_path / "broken.json"))


def test_synthetic_profile_is_seeded_and_validated() -> None:
    a = build_synthetic_trace("random:n=20,in=10-50,out=5,rate=4,prefix=3,seed=1")
    b = build_synthetic_trace("random:n=20,in=10-50,out=5,rate=4,prefix=3,seed=1")
    assert a.requests == b.requests and len(a.requests) == 20
    assert all(10 <= r.input_length <= 50 and r.output_length == 5 for r in a.requests)
    assert {r.hash_ids[0] for r in a.requests} <= {0, 1, 2}
    with pytest.raises(TraceError, match="bad term 'bogus=1'"):
        build_synthetic_trace("random:bogus=1")
    with pytest.raises(TraceError, match="LOW <= HIGH"):
        build_synthetic_trace("random:in=50-10")


def test_write_then_read_round_trips(tmp_path) -> None:
    trace = build_synthetic_trace("random:n=5,in=4-8,out=2,rate=10,prefix=2")
    again = load_trace(str(write_jsonl_trace(trace, tmp_path / "t.jsonl")))
    assert [(r.input_length, r.output_length, r.hash_ids) for r in again.requests] == [
        (r.input_length, r.output_length, r.hash_ids) for r in trace.requests
    ]


def test_shared_hash_ids_become_shared_prompt_prefixes_but_not_across_rounds(tmp_path) -> None:
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps(x) for x in MOONCAKE])
    trace = load_trace(path)
    vocab = np.arange(100, 1100)
    first, second, short = build_bench_requests(trace, vocab, round_index=0)
    assert first.prompt_len == 600 and short.prompt_len == 30
    n = HASH_BLOCK_TOKENS
    assert first.prompt_token_ids[:n] == second.prompt_token_ids[:n]  # block 0 shared
    assert first.prompt_token_ids[n:] != second.prompt_token_ids[n:600]
    other_round = build_bench_requests(trace, vocab, round_index=1)[0]
    assert other_round.prompt_token_ids[:n] != first.prompt_token_ids[:n]


def test_sample_keeps_a_window_of_arrivals() -> None:
    trace = build_synthetic_trace("random:n=50,in=4,out=2,rate=10")
    window = trace.sample(10, seed=3)
    assert len(window.requests) == 10 and window.requests[0].timestamp_ms == 0
    gaps = np.diff(window.arrival_offsets_s())
    all_gaps = np.diff(trace.arrival_offsets_s())
    assert any(np.allclose(gaps, all_gaps[i : i + 9]) for i in range(len(all_gaps) - 8))
