"""SageMaker's contract and vLLM's load probe: ``/ping``, ``/invocations`` and ``/load``.

``/ping`` answers as ``/health`` does (GET or POST). ``/invocations`` takes any API's body and
hands it to the route whose body it is, as vLLM decides: ``messages`` is a chat completion,
``prompt`` a completion, ``input`` an embedding (``--runner pooling``), ``text_1``/``text_2``
a score and ``query``/``documents`` a rerank; anything else is a 400 listing those shapes.
``/load`` reports the HTTP requests in flight on the model routes (vLLM's
``{"server_load": N}``, which it tracks under ``--enable-server-load-tracking``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.protocol import decode_json_object
from tokenmill.entrypoints.openai.routers import chat, completions, embeddings, health, score
from tokenmill.entrypoints.openai.state import get_state
from tokenmill.errors import InvalidRequestError

router = APIRouter()

Handler = Callable[[Request], Awaitable[Response]]


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    return await health.health(request)


@router.get("/load")
async def load(request: Request) -> JSONResponse:
    return JSONResponse({"server_load": request.app.state.admission.num_requests_in_flight})


def _handler(request: Request, data: dict) -> Handler:
    is_pooling = get_state(request).engine_config.is_pooling
    if "messages" in data and not is_pooling:
        return chat.create_chat_completion
    if "prompt" in data and not is_pooling:
        return completions.create_completion
    if "input" in data and is_pooling:
        return embeddings.create_embeddings
    if "text_1" in data and "text_2" in data and is_pooling:
        return score.create_score
    if "query" in data and "documents" in data and is_pooling:
        return score.create_rerank
    shapes = (
        "an embeddings body (input), a score body (text_1, text_2) or a rerank body (query, documents)"
        if is_pooling
        else "a chat completion body (messages) or a completion body (prompt)"
    )
    raise InvalidRequestError(
        f"/invocations cannot tell which API this body is for: this server takes {shapes}"
    )


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    data = decode_json_object(await request.body(), request.headers.get("content-type"))
    return await _handler(request, data)(request)
