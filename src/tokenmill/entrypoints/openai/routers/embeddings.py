"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /pooling`` (vLLM's), under ``--runner pooling``.

Each input becomes one prompt-only engine request, pooled as the checkpoint declares
(``pooling.py``); the answer lists the vectors in input order with the prompt tokens used.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.generation_request import ParsedRequest, parse_request
from tokenmill.entrypoints.openai.pooling import (
    encode_vector,
    pool_inputs,
    pooling_params,
)
from tokenmill.entrypoints.openai.pooling_protocol import EmbeddingRequest, PoolingRequest

router = APIRouter()


EmbeddingT = TypeVar("EmbeddingT", bound=EmbeddingRequest)


async def _vectors(req: ParsedRequest[EmbeddingT]) -> tuple[list[list[float]], int]:
    body = req.body
    params = pooling_params(req, body.dimensions, body.normalize)
    return await pool_inputs(req, body.inputs(), params)


def _envelope(req: ParsedRequest[Any], data: list[dict[str, Any]], num_tokens: int) -> JSONResponse:
    return JSONResponse(
        {
            "id": req.request_id,
            "object": "list",
            "created": int(time.time()),
            "model": req.model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        },
        headers=req.headers,
    )


async def _pooled_response(
    request: Request, body_cls: type[Any], id_prefix: str, object_name: str, vector_key: str
) -> Response:
    """/v1/embeddings and /pooling: the same pooled vectors, each API's own item shape."""
    req = await parse_request(request, body_cls, id_prefix, runner="pooling")
    vectors, num_tokens = await _vectors(req)
    fmt = req.body.encoding_format
    data = [
        {"index": i, "object": object_name, vector_key: encode_vector(v, fmt)}
        for i, v in enumerate(vectors)
    ]
    return _envelope(req, data, num_tokens)


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    return await _pooled_response(request, EmbeddingRequest, "embd", "embedding", "embedding")


@router.post("/pooling")
async def create_pooling(request: Request) -> Response:
    return await _pooled_response(request, PoolingRequest, "pool", "pooling", "data")
