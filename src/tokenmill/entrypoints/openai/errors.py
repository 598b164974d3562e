"""Errors of the HTTP API, always in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Owns the mapping from every failure (bad input, auth, admission, engine death, bugs) to a
status code and that JSON body, both for plain responses and for a stream that already
began. Messages are written for clients: an unexpected exception is logged with its
traceback on the server and answered with a generic message and the request id, so no
stack trace, file path or memory address ever leaves the process.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineDeadError, EngineNotReadyError
from tokenmill.entrypoints.openai.streaming import ClientDisconnected
from tokenmill.errors import (
    ContextLengthError,
    FeatureNotAllowedError,
    InvalidRequestError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as is (status, OpenAI body, optional headers)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        fallback = "internal_server_error" if status_code >= 500 else "invalid_request_error"
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, fallback)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body_bytes(
    status_code: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """A serialized error body, for pure-ASGI middleware that answers before the app."""
    return json.dumps(APIError(status_code, message, code=code, param=param).body()).encode()


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{4,}\b")
_ABSOLUTE_PATH = re.compile(r"(?<![\w/.:-])(?:[A-Za-z]:)?[/\\](?:[^\s'\"`/\\]+[/\\])+[^\s'\"`]*")


def scrub(message: str) -> str:
    """Drop memory addresses and absolute file paths from a client-facing message.

    Bad-input messages can quote text from untrusted sources (a chat template's
    ``raise_exception``, a tokenizer error), so they are scrubbed before leaving.
    """
    return _ABSOLUTE_PATH.sub("<path>", _ADDRESS.sub("0x…", message))


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map any exception to the APIError a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(
            400, scrub(exc.message), param=exc.param or "prompt", code="context_length_exceeded"
        )
    if isinstance(exc, FeatureNotAllowedError):  # a route's choice, not a malformed request
        return APIError(403, exc.message, param=exc.param, code="feature_not_allowed")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, scrub(exc.message), param=exc.param)
    if isinstance(exc, EngineNotReadyError):
        return APIError(
            503, "the model is still loading; retry shortly", headers={"Retry-After": "5"}
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            500,
            "the inference engine failed; this server cannot serve requests",
            code="engine_dead",
        )
    suffix = f" (request id {request_id})" if request_id else ""
    if isinstance(exc, RequestFailedError):  # the engine logged why and serves on
        return APIError(
            500, f"the engine failed on this request{suffix}; it was aborted", code="request_failed"
        )
    return APIError(500, f"internal server error{suffix}")


def _request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def install_exception_handlers(app: FastAPI) -> None:
    """Route every exception the app raises to an OpenAI-shaped JSON response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = "no such route; see the OpenAI API reference for the served endpoints"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on this route"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(
            status_code=499
        )  # nginx's "client closed request": only the access log sees it

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return to_api_error(exc).response()

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(request: Request, exc: EngineNotReadyError) -> JSONResponse:
        return to_api_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = _request_id(request)
        logger.exception("unhandled error in request %s", request_id)
        return to_api_error(exc, request_id).response()
