"""``serve --record-trace FILE``: the served traffic's shape, as a Mooncake-format JSONL trace.

One line per finished generation request: arrival time in ms since the first recorded one,
prompt and generated token counts, and ``hash_ids`` (chained hashes of the prompt's
512-token blocks, numbered in order of first sight, so requests that share a prefix share
ids). Prompt text is written only with ``--record-trace-prompts``: a trace without it holds
no user content. ``tokenmill tune --workload FILE`` replays it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HASH_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block (the Mooncake trace's block size)."""

RECORDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class TraceRecorder:
    """Appends one JSON line per request to ``path``; block hashes numbered across the file."""

    def __init__(self, path: str | Path, with_prompts: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.with_prompts = with_prompts
        self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self._block_ids: dict[bytes, int] = {}
        self._t0_s: float | None = None

    def hash_ids(self, token_ids: list[int]) -> list[int]:
        """Ids of the prompt's blocks; each block's hash chains the previous one's."""
        out, previous = [], b""
        for start in range(0, len(token_ids), HASH_BLOCK_TOKENS):
            block = token_ids[start : start + HASH_BLOCK_TOKENS]
            digest = hashlib.blake2b(previous + json.dumps(block).encode(), digest_size=16).digest()
            out.append(self._block_ids.setdefault(digest, len(self._block_ids)))
            previous = digest
        return out

    def record(
        self, arrival_s: float, generation: dict[str, Any], body: dict[str, Any] | None
    ) -> None:
        with self._lock:
            if self._t0_s is None:
                self._t0_s = arrival_s
            line: dict[str, Any] = {
                "timestamp": round((arrival_s - self._t0_s) * 1000, 3),
                "input_length": int(generation.get("prompt_tokens") or 0),
                "output_length": int(generation.get("completion_tokens") or 0),
            }
            ids = generation.get("prompt_token_ids")
            if ids:
                line["hash_ids"] = self.hash_ids(list(ids))
            if self.with_prompts and body is not None:
                if isinstance(body.get("prompt"), str):
                    line["prompt"] = body["prompt"]
                elif isinstance(body.get("messages"), list):
                    line["messages"] = body["messages"]
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


class TraceRecordMiddleware:
    """Records every finished completion or chat request that produced tokens."""

    def __init__(self, app: ASGIApp, recorder: TraceRecorder) -> None:
        self.app = app
        self.recorder = recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in RECORDED_PATHS:
            await self.app(scope, receive, send)
            return
        arrival_s = time.time()
        chunks: list[bytes] = []

        async def receive_and_keep() -> Message:
            message = await receive()
            if self.recorder.with_prompts and message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        try:
            await self.app(scope, receive_and_keep, send)
        finally:
            generation = scope.get("state", {}).get("generation") or {}
            if generation.get("completion_tokens"):
                body = None
                if chunks:
                    try:
                        body = json.loads(b"".join(chunks))
                    except ValueError:
                        body = None
                self.recorder.record(
                    arrival_s, generation, body if isinstance(body, dict) else None
                )
