"""--reasoning-parser: <think> text is split into reasoning and content, whole or streamed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.entrypoints.openai.reasoning import ReasoningStreamer, is_thinking, split_reasoning


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("plan</think>answer", ("plan", "answer")),  # the template wrote <think> into the prompt
        ("<think>still thinking", ("still thinking", None)),  # cut off while thinking
        ("no markup at all", ("no markup at all", None)),  # deepseek_r1: all reasoning
        ("<think>done</think>", ("done", None)),  # stopped right after thinking
        ("a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_split_reasoning_as_vllm(text: str, expected: tuple[str | None, str | None]) -> None:
    assert split_reasoning(text) == expected


def test_qwen3_honours_enable_thinking_false_and_deepseek_always_thinks() -> None:
    assert is_thinking("qwen3", {"enable_thinking": False}) is False
    assert is_thinking("qwen3", {}) is True
    assert is_thinking("deepseek_r1", {"enable_thinking": False}) is True
    assert is_thinking(None, {}) is False


def _stream(pieces: list[str]) -> tuple[str, str]:
    streamer = ReasoningStreamer()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = streamer.feed(piece, is_last=i == len(pieces) - 1)
        reasoning += r
        content += c
    return reasoning, content


@given(
    text=st.sampled_from(
        [
            "<think>plan it</think>the answer",
            "plan</think>answer <b>bold</b>",
            "<think>never ends </thi",
            "<think></think>only answer",
            "<thin",
            "x < y and </ but not the end",
        ]
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
)
def test_streaming_gives_the_same_split_however_the_text_is_cut(text: str, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)] or [""]
    reasoning, content = split_reasoning(text)
    assert _stream(pieces) == (reasoning or "", content or "")


def test_streaming_holds_back_only_a_partial_end_marker() -> None:
    streamer = ReasoningStreamer()
    assert streamer.feed("<think>abc</th") == ("abc", "")
    assert streamer.feed("ink>de") == ("", "de")
    assert streamer.feed("f") == ("", "f")
