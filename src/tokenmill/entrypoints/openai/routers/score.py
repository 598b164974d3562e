"""``POST /score`` and ``POST /rerank`` (also ``/v1/score``, ``/v1/rerank``, ``/v2/rerank``), as vLLM
serves them for an embedding model (``--runner pooling``): the score of two texts is the
cosine similarity of their embeddings. Cross-encoder scoring (a classification head) is not
built: this engine's causal LMs have none.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.generation_request import parse_request
from tokenmill.entrypoints.openai.pooling import cosine, pool_inputs, pooling_params
from tokenmill.entrypoints.openai.pooling_protocol import RerankRequest, ScoreRequest

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: Request) -> Response:
    req = await parse_request(request, ScoreRequest, "score", runner="pooling")
    pairs = req.body.pairs()
    left = list(dict.fromkeys(a for a, _ in pairs))
    right = [b for _, b in pairs]
    vectors, num_tokens = await pool_inputs(req, [*left, *right], pooling_params(req), "text_2")
    by_text = dict(zip(left, vectors[: len(left)], strict=True))
    data = [
        {"index": i, "object": "score", "score": cosine(by_text[a], vectors[len(left) + i])}
        for i, (a, _) in enumerate(pairs)
    ]
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


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: Request) -> Response:
    req = await parse_request(request, RerankRequest, "rerank", runner="pooling")
    body = req.body
    vectors, num_tokens = await pool_inputs(
        req, [body.query, *body.documents], pooling_params(req), "documents"
    )
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = [
        {
            "index": i,
            "relevance_score": scores[i],
            **({"document": {"text": body.documents[i]}} if body.return_documents else {}),
        }
        for i in order
    ]
    return JSONResponse(
        {
            "id": req.request_id,
            "model": req.model,
            "usage": {"total_tokens": num_tokens},
            "results": results,
        },
        headers=req.headers,
    )
