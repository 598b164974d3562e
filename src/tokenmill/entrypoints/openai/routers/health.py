"""Operational endpoints: ``/health``, ``/version`` and ``/metrics``.

``/health`` is 200 only while the engine is loaded and alive and the server is not
draining, so a load balancer stops sending traffic while the model loads, after the engine
died, and during a graceful shutdown. ``HEAD /health`` and ``HEAD /metrics`` answer as GET
without the body, for probes that only read the status. None of these touch the model or
the tokenizer.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import tokenmill
from tokenmill.engine.async_engine import EngineState
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.state import get_state
from tokenmill.metrics.names import CONTENT_TYPE

router = APIRouter()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tokenmill")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return getattr(tokenmill, "__version__", "0.0.0")


@router.get("/health")
@router.head("/health")
async def health(request: Request) -> Response:
    state = get_state(request)
    if state.is_healthy:
        return Response(status_code=200)
    engine_state = state.engine.state
    if state.is_draining:
        message = "the server is shutting down"
    elif engine_state in (EngineState.CREATED, EngineState.LOADING):
        message = "the model is loading"
    else:
        message = "the engine is not running"
    return APIError(503, message, code="unhealthy").response()


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": _version()})


@router.get("/metrics")
@router.head("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)
