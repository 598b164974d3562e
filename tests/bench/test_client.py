"""SSE chunk rules of the serve client, on hand-made chunk sequences."""

from __future__ import annotations

import pytest

from tokenmill.bench.client import (
    RequestOptions,
    _StreamState,
    build_payload,
    consume_chunk,
    finish_record,
)
from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import RequestRecord


def _text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def _delta(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_completion_chunks_give_ttft_itl_and_e2e() -> None:
    state = _StreamState()
    for t, chunk in [
        (0.1, _text("a")),
        (0.15, _text("")),
        (0.3, _text("c", "length")),
        (0.31, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}),
    ]:
        consume_chunk(state, chunk, t, is_chat=False)
    record = finish_record(RequestRecord(0), state, BenchRequest(9, 3, prompt_token_ids=[1]), None)
    assert record.success and record.ttft_s == 0.1
    # The empty-text chunk is a token (a special token decodes to nothing), as in vLLM.
    assert record.itl_s == pytest.approx([0.05, 0.15])
    assert record.e2e_s == 0.3  # the usage-only chunk does not extend E2E
    assert (record.prompt_tokens, record.output_tokens, record.output_tokens_source) == (
        4,
        3,
        "usage",
    )
    assert record.generated_text == "ac"


def test_chat_role_and_trailing_finish_chunks_are_not_tokens() -> None:
    state = _StreamState()
    for t, chunk in [
        (0.01, _delta({"role": "assistant", "content": ""})),
        (0.2, _delta({"content": "x"})),
        (0.25, _delta({"content": "y"})),
        (0.26, _delta({}, "stop")),
    ]:
        consume_chunk(state, chunk, t, is_chat=True)
    record = finish_record(RequestRecord(0), state, BenchRequest(5, 8, prompt_text="hi"), None)
    assert record.ttft_s == 0.2 and record.itl_s == pytest.approx([0.05])
    assert record.e2e_s == 0.26
    # No usage and no tokenizer: the token chunks are counted.
    assert (record.output_tokens, record.output_tokens_source, record.prompt_tokens) == (
        2,
        "chunks",
        5,
    )


def test_a_lone_finish_chunk_is_the_first_token() -> None:
    state = _StreamState()
    consume_chunk(state, _text("", "stop"), 0.2, is_chat=False)
    record = finish_record(RequestRecord(0), state, BenchRequest(5, 8, prompt_text="hi"), None)
    assert record.success and record.ttft_s == 0.2 and record.e2e_s == 0.2


def test_output_tokens_fall_back_to_the_tokenizer(char_tokenizer) -> None:
    state = _StreamState()
    consume_chunk(state, _text("abc de"), 0.1, is_chat=False)
    record = finish_record(
        RequestRecord(0), state, BenchRequest(5, 8, prompt_text="hi"), char_tokenizer
    )
    assert (record.output_tokens, record.output_tokens_source) == (6, "tokenizer")


def test_empty_stream_is_a_failure() -> None:
    record = finish_record(
        RequestRecord(0), _StreamState(), BenchRequest(5, 8, prompt_text="hi"), None
    )
    assert not record.success and "empty response" in record.error


def test_payloads() -> None:
    both = BenchRequest(3, 7, prompt_token_ids=[1, 2, 3], prompt_text="abc")
    opts = RequestOptions(
        url="http://127.0.0.1:1/v1/completions", model="m", use_token_ids=True, ignore_eos=True
    )
    body = build_payload(both, opts)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert build_payload(both, RequestOptions(url="u", model="m"))["prompt"] == "abc"
    chat = build_payload(
        both, RequestOptions(url="u", model="m", is_chat=True, extra_body={"top_p": 0.5})
    )
    assert chat["messages"] == [{"role": "user", "content": "abc"}] and chat["top_p"] == 0.5
    with pytest.raises(ValueError, match="tokenizer"):
        build_payload(
            BenchRequest(3, 7, prompt_token_ids=[1]),
            RequestOptions(url="u", model="m", is_chat=True),
        )
