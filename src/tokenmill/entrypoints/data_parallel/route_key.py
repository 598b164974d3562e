"""The leading token ids of a request, as its replica will see them: what routing hashes.

The front end renders chat requests with the model's chat template and tokenizes them with
the model's tokenizer (tokenmill's own, as the replicas do), so a shared system prompt gives
the same leading blocks here as in the replica's paged cache. Only the first
``max_chars`` characters are tokenized (routing needs the leading blocks, not the whole
prompt) and the last token is dropped, since the cut may have split it. Any body this cannot
read routes as "no prefix" (least loaded): the replica validates and answers the error.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.tokenizer.tokenizer import Tokenizer


class RouteKeys:
    """Turns a request body into the token ids its routing is based on."""

    def __init__(
        self, tokenizer: Tokenizer, max_chars: int, chat_template: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.chat_template = chat_template

    def token_ids(self, path: str, body: bytes) -> list[int] | None:
        """Leading prompt token ids of a request to ``path``, or None when there is no prompt."""
        try:
            payload = json.loads(body)
        except ValueError:
            return None
        if not isinstance(payload, dict):
            return None
        try:
            return self._token_ids(path, payload)
        except Exception:  # a malformed body: the replica says what is wrong with it
            return None

    def _token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            return self._chat(payload.get("messages"))
        if path.endswith("/messages"):  # Anthropic: a top-level system prompt
            messages = list(payload.get("messages") or [])
            system = payload.get("system")
            if system:
                messages.insert(0, {"role": "system", "content": system})
            return self._chat(messages)
        if path.endswith("/responses"):
            items = payload.get("input")
            messages = (
                [{"role": "user", "content": items}]
                if isinstance(items, str)
                else list(items or [])
            )
            if payload.get("instructions"):
                messages.insert(0, {"role": "system", "content": payload["instructions"]})
            return self._chat(messages)
        for field in ("prompt", "input"):  # completions; embeddings and pooling
            if field in payload:
                return self._prompt(payload[field])
        return None

    def _prompt(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch routes by its first prompt
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def _chat(self, messages: Any) -> list[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        normalized = [_plain_message(m) for m in messages if isinstance(m, dict)]
        text = self.tokenizer.apply_chat_template(
            normalized,
            add_generation_prompt=True,
            chat_template=self.chat_template,
            max_chars=None,
            time_budget_s=1.0,
        )
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= self.max_chars:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = self.tokenizer.encode(text[: self.max_chars], add_special_tokens=add_special_tokens)
        return ids[:-1]


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its content as plain text (text parts joined), as templates take it."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return {"role": str(message.get("role", "user")), "content": content or ""}
