"""A tiny real OpenAI-compatible streaming server with known timings, for bench tests.

It answers ``/v1/completions`` and ``/v1/chat/completions`` by streaming ``max_tokens``
chunks: the first after ``ttft_delay_s``, each next one ``itl_delay_s`` later, so the
bench client's TTFT/ITL/TPOT maths can be checked end to end against known delays. It
also serves ``/v1/models``, a Prometheus ``/metrics`` with tokenmill-style names, and
``/tokenize``/``/detokenize`` in vLLM's or llama.cpp's shape (one token per character, the
id being its code point), all behind an API key when ``required_api_key`` is set (401
otherwise, as tokenmill does).
Runs uvicorn in a thread on 127.0.0.1 with a free port; nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL_NAME = "fake-model"


@dataclass
class FakeBehavior:
    """Knobs a test turns; read on every request."""

    ttft_delay_s: float = 0.1
    itl_delay_s: float = 0.03
    accepts_token_ids: bool = True
    sends_usage: bool = True
    separate_finish_chunk: bool = False
    fail_marker: str | None = None
    """Prompts containing this text (or token id 0 when ids) get an HTTP 500."""
    has_metrics: bool = True
    loading_requests_left: int = 0
    """Answer this many generation requests with 503, as a server still loading."""
    required_api_key: str | None = None
    """When set, every route wants ``Authorization: Bearer <key>`` and answers 401 without it."""
    tokenize_style: str | None = "vllm"
    """``vllm`` (strict ``{"model", "prompt"}``), ``llama.cpp`` (``{"content"}``), or None for no route (404)."""
    tokenize_bodies: list[dict[str, Any]] = field(default_factory=list)
    num_in_flight: int = 0
    peak_in_flight: int = 0
    num_requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", ""))) for m in body["messages"])
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt))


def _is_failure(body: dict[str, Any], behavior: FakeBehavior) -> bool:
    if behavior.fail_marker is None:
        return False
    prompt = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
    if isinstance(prompt, list):
        return 0 in prompt
    return behavior.fail_marker in str(prompt)


def build_app(behavior: FakeBehavior) -> Starlette:
    """The ASGI app; ``behavior`` can be changed between requests."""

    async def stream(body: dict[str, Any], is_chat: bool) -> AsyncIterator[str]:
        num_tokens = int(body.get("max_tokens") or 16)
        include_usage = (
            bool((body.get("stream_options") or {}).get("include_usage")) and behavior.sends_usage
        )
        obj = "chat.completion.chunk" if is_chat else "text_completion"
        behavior.num_in_flight += 1
        behavior.peak_in_flight = max(behavior.peak_in_flight, behavior.num_in_flight)
        try:
            if is_chat:
                # A role announcement right away: it must not count as the first token.
                yield _sse(
                    {
                        "object": obj,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                    }
                )
            for i in range(num_tokens):
                await asyncio.sleep(behavior.ttft_delay_s if i == 0 else behavior.itl_delay_s)
                is_last = i == num_tokens - 1 and not behavior.separate_finish_chunk
                text = f"w{i % 10} "
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": "length" if is_last else None,
                }
                if is_chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                yield _sse({"object": obj, "choices": [choice]})
            if behavior.separate_finish_chunk:
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"delta": {}} if is_chat else {"text": ""})
                yield _sse({"object": obj, "choices": [choice]})
            if include_usage:
                prompt_tokens = _prompt_tokens(body)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": num_tokens,
                    "total_tokens": prompt_tokens + num_tokens,
                }
                yield _sse({"object": obj, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            behavior.num_in_flight -= 1

    def unauthorized(request: Request) -> Response | None:
        if behavior.required_api_key is None:
            return None
        if request.headers.get("authorization") == f"Bearer {behavior.required_api_key}":
            return None
        return JSONResponse(
            {"error": {"message": "invalid API key", "type": "authentication_error"}},
            status_code=401,
        )

    async def handle(request: Request, is_chat: bool) -> Response:
        if (refusal := unauthorized(request)) is not None:
            return refusal
        body = await request.json()
        if behavior.loading_requests_left > 0:
            behavior.loading_requests_left -= 1
            return JSONResponse(
                {"error": {"message": "the model is still loading"}}, status_code=503
            )
        behavior.bodies.append(body)
        behavior.num_requests += 1
        if not is_chat and isinstance(body.get("prompt"), list) and not behavior.accepts_token_ids:
            return JSONResponse(
                {"error": {"message": "prompt must be a string", "type": "invalid_request_error"}},
                status_code=400,
            )
        if _is_failure(body, behavior):
            return JSONResponse(
                {"error": {"message": "injected failure", "type": "server_error"}}, status_code=500
            )
        return StreamingResponse(stream(body, is_chat), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await handle(request, is_chat=False)

    async def chat(request: Request) -> Response:
        return await handle(request, is_chat=True)

    async def models(request: Request) -> Response:
        if (refusal := unauthorized(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        if (refusal := unauthorized(request)) is not None:
            return refusal
        if not behavior.has_metrics:
            return PlainTextResponse("not found", status_code=404)
        lines = [
            "# HELP tokenmill:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE tokenmill:kv_cache_usage_perc gauge",
            f'tokenmill:kv_cache_usage_perc{{model_name="{MODEL_NAME}",engine="0"}} {behavior.num_in_flight / 10}',
            "# TYPE tokenmill:num_preemptions_total counter",
            f'tokenmill:num_preemptions_total{{model_name="{MODEL_NAME}"}} {float(behavior.num_requests)}',
            f'tokenmill:num_requests_running{{model_name="{MODEL_NAME}"}} {float(behavior.num_in_flight)}',
            "process_resident_memory_bytes 1.048576e+08",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def tokenize(request: Request) -> Response:
        if (refusal := unauthorized(request)) is not None:
            return refusal
        body = await request.json()
        behavior.tokenize_bodies.append(body)
        if behavior.tokenize_style == "vllm":
            if set(body) - {"model", "prompt", "add_special_tokens"} or not isinstance(
                body.get("prompt"), str
            ):
                return JSONResponse({"error": {"message": "bad tokenize body"}}, status_code=400)
            tokens = [ord(c) for c in body["prompt"]]
            return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})
        if (
            behavior.tokenize_style == "llama.cpp"
        ):  # a body without content tokenizes to nothing, as llama.cpp does
            return JSONResponse({"tokens": [ord(c) for c in str(body.get("content", ""))]})
        return PlainTextResponse("not found", status_code=404)

    async def detokenize(request: Request) -> Response:
        if (refusal := unauthorized(request)) is not None:
            return refusal
        body = await request.json()
        text = "".join(chr(t) for t in body.get("tokens", []))
        if behavior.tokenize_style == "vllm":
            return JSONResponse({"prompt": text})
        if behavior.tokenize_style == "llama.cpp":
            return JSONResponse({"content": text})
        return PlainTextResponse("not found", status_code=404)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
        ]
    )


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


class FakeServer:
    """Runs the app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, behavior: FakeBehavior | None = None) -> None:
        self.behavior = behavior or FakeBehavior()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.behavior), log_level="warning", lifespan="off", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
