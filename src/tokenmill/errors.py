"""Exception types that carry enough context for a clear message to the user.

Every error raised for bad user input derives from ``InvalidRequestError`` and names the
offending parameter, so the HTTP layer can answer with OpenAI's ``param`` field.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request parameter is invalid; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestLimitError(InvalidRequestError):
    """A request is over one of its bounds (``engine/request_limits.py`` computes them all).

    ``limit`` names the bound (e.g. ``"context"``, ``"route_max_tokens"``, ``"n"``),
    ``value`` is what the request asked for and ``bound`` what it may ask; the HTTP layer
    only turns this into the API's own error body (400)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        limit: str = "",
        value: int | None = None,
        bound: int | None = None,
    ) -> None:
        super().__init__(message, param)
        self.limit = limit
        self.value = value
        self.bound = bound


class ContextLengthError(RequestLimitError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit the context window."""


class FeatureNotAllowedError(RequestLimitError):
    """A route does not allow what the request asks for (over HTTP: 403 ``feature_not_allowed``)."""


class ModelLoadError(TokenmillError):
    """A model folder could not be loaded; the message names the file and tensor."""


class ConfigError(TokenmillError, ValueError):
    """An engine configuration value is invalid."""


class InsufficientMemoryError(TokenmillError):
    """What the flags size (weights, KV, LoRA slots) does not fit the memory there is."""


class RequestFailedError(TokenmillError):
    """One request raised inside the engine step; it was aborted, every other request goes on."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"the engine failed on request {request_id}; it was aborted")
        self.request_id = request_id
