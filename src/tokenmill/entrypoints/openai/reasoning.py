"""``--reasoning-parser``: a model's ``<think>...</think>`` text becomes ``reasoning_content``.

vLLM's ``deepseek_r1`` and ``qwen3`` parsers read the same markup: an optional ``<think>``
(chat templates often write it into the prompt), reasoning up to ``</think>``, then the
answer. Without ``</think>`` the whole output is reasoning (the model was cut off while
thinking). ``qwen3`` differs only in honouring ``chat_template_kwargs.enable_thinking:
false``, where the output is all answer. Responses carry the reasoning as both
``reasoning_content`` (DeepSeek's API, vLLM before 0.11, most clients) and ``reasoning``
(vLLM's current name). Streaming holds back only a partial ``</think>`` at a chunk's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""The ``--reasoning-parser`` names tokenmill implements."""

THINK_START = "<think>"
THINK_END = "</think>"


def is_thinking(parser: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether this request's output starts in reasoning (False: no parser, or thinking off)."""
    if parser is None:
        return False
    if parser == "qwen3" and chat_template_kwargs is not None:
        return chat_template_kwargs.get("enable_thinking", True) is not False
    return True


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole output; None for an empty part (as vLLM answers)."""
    before, start, after = text.partition(THINK_START)
    text = after if start else before
    if THINK_END not in text:
        return text, None
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content or None


def reasoning_fields(reasoning: str | None) -> dict[str, str]:
    """The message fields a choice's reasoning goes in (none when there was none)."""
    if reasoning is None:
        return {}
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStreamer:
    """Splits one choice's streamed text into reasoning and content deltas."""

    def __init__(self) -> None:
        self._is_reasoning = True
        self._is_started = False
        """Whether the output is past a possible leading ``<think>``."""
        self._pending = ""

    def feed(self, delta: str, is_last: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` text this delta releases; ``is_last`` flushes what is held."""
        text = self._pending + delta
        self._pending = ""
        reasoning = content = ""
        if not self._is_started:
            stripped = text.lstrip()
            if THINK_START.startswith(stripped) and stripped != THINK_START and not is_last:
                self._pending = text  # maybe the start of "<think>": wait for more
                return "", ""
            self._is_started = True
            if stripped.startswith(THINK_START):
                text = stripped[len(THINK_START) :]
        if self._is_reasoning:
            head, end, tail = text.partition(THINK_END)
            if end:
                self._is_reasoning = False
                reasoning, text = head, tail
            else:
                held = 0 if is_last else _partial_suffix(text, THINK_END)
                self._pending = text[len(text) - held :] if held else ""
                return text[: len(text) - held], ""
        content = text
        return reasoning, content
