"""The OpenAPI document served at ``/openapi.json``: the real request and response bodies.

Owns what the document says. Routes decode and validate their bodies themselves (so bad
JSON gets OpenAI's error shape, see protocol.py), which FastAPI cannot see; this module
puts protocol.py's request models into the document as the request bodies, describes each
route's responses with the models below (documentation only: routes build plain dicts), and
says which routes need the API key, as the server is configured.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import tokenmill
from tokenmill.entrypoints.openai.admission import GENERATION_PATHS
from tokenmill.entrypoints.openai.anthropic import (
    MESSAGES_PATH_PREFIX,
    CountTokensRequest,
    MessagesRequest,
)
from tokenmill.entrypoints.openai.auth import OPEN_PATHS
from tokenmill.entrypoints.openai.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.responses_api import ResponsesRequest
from tokenmill.entrypoints.openai.routers.lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from tokenmill.entrypoints.openai.state import ServerConfig

_SCHEMA_REF = "#/components/schemas/{model}"
_ERRORS_BY_METHOD = {
    "post": (400, 401, 404, 413, 415, 431, 500, 503),
    "get": (400, 401, 404, 431, 500, 503),
    "delete": (400, 401, 404, 431, 500, 503),
}
"""Statuses an operation may answer with an error; generation routes add 429 (admission)."""


# ---- response bodies -------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Errors on ``/v1/messages*``, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens the prefix cache served."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    """With ``--enable-prompt-tokens-details``."""


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs object."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's: per prompt position, token id -> logprob (only when asked for)."""
    prompt_token_ids: list[int] | None = None
    """vLLM's, with ``return_token_ids``."""
    token_ids: list[int] | None = None
    """vLLM's, with ``return_token_ids``."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    logprob: float | None  # type: ignore[assignment]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: str
    """``assistant`` (``--response-role``)."""
    content: str | None
    reasoning_content: str | None = None
    """With ``--reasoning-parser``: the text up to ``</think>``; also as ``reasoning``."""
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    """vLLM's, with ``return_token_ids``."""


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    """vLLM's, with ``return_token_ids``."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, with ``prompt_logprobs``."""


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    """In a choice's first chunk, with ``return_token_ids``."""
    token_ids: list[int] | None = None


class CompletionChunk(BaseModel):
    """One ``data:`` event of a streamed completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    """In the last chunk with ``include_usage``; in every chunk with ``continuous_usage_stats``."""


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With ``return_token_ids``."""


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    """In the first chunk, with ``return_token_ids``."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """With the first output, with ``prompt_logprobs``."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class ResponseObject(BaseModel):
    """OpenAI's Response (docs/apis.md lists its fields)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class AnthropicMessageResponse(BaseModel):
    """Anthropic's Message."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int]


class CountTokensResponse(BaseModel):
    input_tokens: int


class PooledItem(BaseModel):
    index: int
    object: Literal["embedding", "pooling"]
    embedding: list[float] | str | None = None
    """``/v1/embeddings``: floats, or base64 of little-endian float32."""
    data: list[float] | str | None = None
    """``/pooling``."""


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[PooledItem]
    usage: PoolingUsage


class ScoreItem(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreItem]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: dict[str, int]
    results: list[RerankResult]


class LoadResponse(BaseModel):
    server_load: int


# ---- the document ----------------------------------------------------------------------------
REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/chat/completions"): ChatCompletionRequest,
    ("post", "/tokenize"): TokenizeRequest,
    ("post", "/detokenize"): DetokenizeRequest,
    ("post", "/v1/load_lora_adapter"): LoadLoRAAdapterRequest,
    ("post", "/v1/unload_lora_adapter"): UnloadLoRAAdapterRequest,
    ("post", "/v1/responses"): ResponsesRequest,
    ("post", "/v1/messages"): MessagesRequest,
    ("post", "/v1/messages/count_tokens"): CountTokensRequest,
    ("post", "/v1/embeddings"): EmbeddingRequest,
    ("post", "/pooling"): PoolingRequest,
    **{("post", path): ScoreRequest for path in ("/score", "/v1/score")},
    **{("post", path): RerankRequest for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
}
"""Operation -> the protocol.py model its body is validated with."""


def _named_sse(error: type[BaseModel]) -> dict[str, Any]:
    """A stream of named events (Responses, Messages): ``event:`` lines and JSON ``data:``."""
    data = {"type": "string", "contentMediaType": "application/json"}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": data},
    }
    return {"text/event-stream": {"schema": event}}


def _sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """A stream: each event's data is a chunk, an error (the stream failed), or ``[DONE]``."""
    payload = {
        "anyOf": [{"$ref": _SCHEMA_REF.format(model=m.__name__)} for m in (chunk, ErrorResponse)]
    }
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


_OK_BODIES: dict[tuple[str, str], tuple[type[BaseModel] | None, dict[str, Any]]] = {
    ("post", "/v1/completions"): (CompletionResponse, _sse(CompletionChunk)),
    ("post", "/v1/chat/completions"): (ChatCompletionResponse, _sse(ChatCompletionChunk)),
    ("post", "/tokenize"): (TokenizeResponse, {}),
    ("post", "/detokenize"): (DetokenizeResponse, {}),
    ("get", "/v1/models"): (ModelList, {}),
    ("get", "/v1/models/{model}"): (ModelCard, {}),
    ("get", "/version"): (VersionResponse, {}),
    ("get", "/health"): (None, {}),
    ("get", "/metrics"): (None, {"text/plain": {"schema": {"type": "string"}}}),
    ("post", "/v1/load_lora_adapter"): (None, {"text/plain": {"schema": {"type": "string"}}}),
    ("post", "/v1/unload_lora_adapter"): (None, {"text/plain": {"schema": {"type": "string"}}}),
    ("post", "/v1/responses"): (ResponseObject, _named_sse(ErrorResponse)),
    ("get", "/v1/responses/{response_id}"): (ResponseObject, {}),
    ("delete", "/v1/responses/{response_id}"): (DeletedResponse, {}),
    ("post", "/v1/messages"): (AnthropicMessageResponse, _named_sse(AnthropicErrorResponse)),
    ("post", "/v1/messages/count_tokens"): (CountTokensResponse, {}),
    ("post", "/v1/embeddings"): (EmbeddingResponse, {}),
    ("post", "/pooling"): (EmbeddingResponse, {}),
    **{("post", path): (ScoreResponse, {}) for path in ("/score", "/v1/score")},
    **{("post", path): (RerankResponse, {}) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    ("get", "/ping"): (None, {}),
    ("post", "/ping"): (None, {}),
    ("get", "/load"): (LoadResponse, {}),
}
"""Operation -> (JSON model of a 200, other media types a 200 may have)."""


def _json_content(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}}


def build_openapi(app: FastAPI, config: ServerConfig) -> dict[str, Any]:
    """The document for ``app``'s routes as this server is configured."""
    document = get_openapi(
        title=app.title,
        version=tokenmill.__version__,
        routes=app.routes,
        description="OpenAI-compatible API of tokenmill (plus vLLM's extras).",
    )
    models = [
        *REQUEST_BODIES.values(),
        ErrorResponse,
        AnthropicErrorResponse,
        CompletionChunk,
        ChatCompletionChunk,
        *(m for m, _ in _OK_BODIES.values() if m is not None),
    ]
    _, definitions = models_json_schema(
        [(m, "validation") for m in dict.fromkeys(models)],  # type: ignore[misc]
        ref_template=_SCHEMA_REF,
    )
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in (
        "HTTPValidationError",
        "ValidationError",
    ):  # FastAPI's 422, which this server never sends
        schemas.pop(unused, None)
    schemas.update(definitions.get("$defs", {}))
    if config.api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            key = ("get" if method == "head" else method, path)
            body = REQUEST_BODIES.get(key)
            if body is not None:
                operation["requestBody"] = {"required": True, "content": _json_content(body)}
            ok_model, ok_other = _OK_BODIES.get(key, (None, {}))
            ok: dict[str, Any] = {"description": "success"}
            if method != "head" and (ok_model is not None or ok_other):
                ok["content"] = {**(_json_content(ok_model) if ok_model else {}), **ok_other}
            errors = _ERRORS_BY_METHOD[key[0]] + ((429,) if path in GENERATION_PATHS else ())
            operation["responses"] = {"200": ok}
            is_anthropic = path.startswith(MESSAGES_PATH_PREFIX)
            for status in sorted(errors):
                error: dict[str, Any] = {
                    "description": f"error, in {'Anthropic' if is_anthropic else 'OpenAI'}'s shape"
                }
                if method != "head":
                    error["content"] = _json_content(
                        AnthropicErrorResponse if is_anthropic else ErrorResponse
                    )
                operation["responses"][str(status)] = error
            if config.api_keys and config.disable_auth_for_health_metrics and path in OPEN_PATHS:
                operation["security"] = []
    return document


def install_openapi(app: FastAPI, config: ServerConfig) -> None:
    """Serve ``build_openapi``'s document (built once, on the first request for it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, config)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
