"""``--enable-log-requests`` / ``--enable-log-outputs``: one log line per request in, one out.

vLLM's lines: the request id, the prompt text (if it came as text), its token ids and the
sampling parameters as the request arrives, and the generated text and token ids when it
ends. ``--max-log-len`` truncates the prompt text and the id lists, so a long prompt costs
one bounded line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("tokenmill.requests")


def _clip(value: Sequence[Any] | str | None, max_len: int | None) -> Any:
    if value is None or max_len is None:
        return value
    return value[:max_len]


def log_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: Sequence[int],
    params: Any,
    max_log_len: int | None,
    lora_name: str | None = None,
) -> None:
    """The line logged when a request's prompt is ready for the engine."""
    logger.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s",
        request_id,
        _clip(prompt, max_log_len),
        params,
        list(_clip(prompt_token_ids, max_log_len)),
        lora_name,
    )


def log_prompts(prompts: Sequence[Any], max_log_len: int | None) -> None:
    """``log_request`` for each ProcessedRequest of one API request."""
    for p in prompts:
        lora = p.lora_request.lora_name if p.lora_request is not None else None
        log_request(p.request_id, p.prompt_text, p.prompt_token_ids, p.params, max_log_len, lora)


def log_output(
    request_id: str,
    index: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    max_log_len: int | None,
) -> None:
    """The line logged for one choice when its request ends."""
    logger.info(
        "Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
        request_id,
        index,
        _clip(text, max_log_len),
        list(_clip(token_ids, max_log_len)),
        finish_reason,
    )
