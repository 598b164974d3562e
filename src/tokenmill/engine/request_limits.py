"""Every bound on a request, computed in one place (no torch).

The input processor asks this module, once per request, whether what a caller sends fits:

- the context: the prompt must leave room for output in the smallest of ``--max-model-len``,
  the KV cache's per-request capacity and the route's ``max_model_len``; a pooling prompt may
  fill it;
- ``max_tokens`` (``max_completion_tokens``): over HTTP, a value the request carries whose
  prompt plus ``max_tokens`` exceeds the context is refused, as vLLM's API servers refuse it
  (``'max_tokens' or 'max_completion_tokens' is too large``); the offline ``LLM`` and
  ``LLMEngine`` do as vLLM's ``LLM``: output stops at the context's end. A request without
  ``max_tokens`` may use the whole remaining context. An operator's cap (the generation
  config's ``max_new_tokens``, a route's ``max_tokens`` when the request sends none) is
  applied without refusing, as vLLM applies ``max_new_tokens``; a request above a route's
  ``max_tokens`` is refused. The resolved value is what the engine runs with.
- ``n``, ``best_of`` and the beam width (``--max-num-seqs``, the vocabulary, a route's
  ``max_n``), ``logprobs``/``prompt_logprobs`` (``--max-logprobs``), and the route's
  features (``logprobs``, ``beam_search``).

Who adds bounds of their own passes them as data: a route as ``RouteCaps``, the server as
``RequestCaps``. A violation raises a ``RequestLimitError`` (``ContextLengthError``,
``FeatureNotAllowedError``) naming the field, the bound and what was asked; the HTTP layer
only maps it to the API's error body.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.errors import ContextLengthError, FeatureNotAllowedError, RequestLimitError


@dataclass(frozen=True)
class InputLimits:
    """The engine's own limits: fixed once the model and KV cache are loaded."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    """The most tokens one request can hold in the KV cache."""
    max_logprobs: int
    scheduling_policy: str
    eos_token_ids: frozenset[int]
    enable_prefix_caching: bool
    enable_lora: bool = False
    supports_beam_search: bool = False
    """Whether the KV strategy can fork a request's blocks (paged can, static cannot)."""
    max_num_seqs: int = 2**31

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus output tokens one request may reach: the context, or the KV cache's
        capacity where that is smaller."""
        return min(self.max_model_len, self.kv_capacity_tokens)


@dataclass(frozen=True)
class RouteCaps:
    """A route's own bounds (docs/routes.md); None or True: no bound of the route's own."""

    name: str
    max_model_len: int | None = None
    """Prompt plus output tokens on this route (no more than the engine's context)."""
    max_input_tokens: int | None = None
    """Longest prompt."""
    max_tokens: int | None = None
    """Refused above it; the default when the request sends no ``max_tokens``."""
    max_n: int | None = None
    """Largest ``n`` and ``best_of``."""
    allow_logprobs: bool = True
    allow_beam_search: bool = True


@dataclass(frozen=True)
class RequestCaps:
    """What a caller adds to the engine's limits for one request (the server, a route)."""

    route: RouteCaps | None = None
    default_max_tokens: int | None = None
    """An operator's cap on ``max_tokens`` (the generation config's ``max_new_tokens``):
    applied without refusing, and the default when the request sends none."""
    max_tokens_must_fit: bool = False
    """Refuse a ``max_tokens`` that leaves the context (vLLM's API servers); False: output
    stops at the context's end (vLLM's offline ``LLM``)."""
    max_tokens_param: str = "max_tokens"
    """The body field the request's ``max_tokens`` came in, for errors."""


OFFLINE = RequestCaps()
"""The offline ``LLM`` and ``LLMEngine.add_request``: the engine's limits only."""


def check_params(params: SamplingParams, limits: InputLimits, caps: RequestCaps = OFFLINE) -> None:
    """The bounds that do not depend on the prompt: route features, the route's
    ``max_tokens``, ``n``/``best_of``/beam width, and logprobs counts."""
    route = caps.route
    if route is not None:
        _check_route_features(params, route)
        cap, asked = route.max_tokens, params.max_tokens
        if cap is not None and asked is not None and asked > cap:
            raise RequestLimitError(
                f"route {route.name!r} allows at most {cap} output tokens; "
                f"got {caps.max_tokens_param}={asked}",
                param=caps.max_tokens_param,
                limit="route_max_tokens",
                value=asked,
                bound=cap,
            )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise RequestLimitError(
                f"{name} must be at most {limits.max_logprobs}, got {value}",
                param=name,
                limit="max_logprobs",
                value=value,
                bound=limits.max_logprobs,
            )
    if params.use_beam_search:
        _check_beam_width(params, limits)


def _check_route_features(params: SamplingParams, route: RouteCaps) -> None:
    def refuse(feature: str, param: str, value: int | None = None) -> FeatureNotAllowedError:
        return FeatureNotAllowedError(
            f"route {route.name!r} does not allow {feature}",
            param=param,
            limit="route_feature",
            value=value,
            bound=route.max_n if value is not None else None,
        )

    if not route.allow_logprobs:
        for param in ("logprobs", "prompt_logprobs"):
            if getattr(params, param) is not None:
                raise refuse("logprobs", param)
    if not route.allow_beam_search and params.use_beam_search:
        raise refuse("beam search", "use_beam_search")
    if route.max_n is not None:
        for param in ("n", "best_of"):
            value = getattr(params, param)
            if value is not None and value > route.max_n:
                raise refuse(f"{param} above {route.max_n}", param, value)


def _check_beam_width(params: SamplingParams, limits: InputLimits) -> None:
    width, param = params.beam_width, "best_of" if params.best_of is not None else "n"
    if width > limits.max_num_seqs:
        raise RequestLimitError(
            f"the beam width ({width}) must not exceed --max-num-seqs ({limits.max_num_seqs})",
            param=param,
            limit="beam_width",
            value=width,
            bound=limits.max_num_seqs,
        )
    num_stop_ids = len(
        set(params.stop_token_ids or []) | (set() if params.ignore_eos else limits.eos_token_ids)
    )
    # Each beam keeps its best candidates that are not stop tokens: the vocabulary must hold them.
    if max(2, 1 + num_stop_ids) * width > limits.vocab_size:
        raise RequestLimitError(
            "the beam width times the number of stop tokens is too large for the vocabulary",
            param=param,
            limit="beam_width",
            value=width,
            bound=limits.vocab_size // max(2, 1 + num_stop_ids),
        )


def context_of(limits: InputLimits, caps: RequestCaps = OFFLINE) -> tuple[int, str]:
    """The tokens prompt plus output may take, and how an error names that bound."""
    bounds = [
        (
            limits.max_model_len,
            f"This model's maximum context length is {limits.max_model_len} tokens",
        ),
        (
            limits.kv_capacity_tokens,
            f"The KV cache holds at most {limits.kv_capacity_tokens} tokens per request",
        ),
    ]
    route = caps.route
    if route is not None and route.max_model_len is not None:
        bounds.append(
            (
                route.max_model_len,
                f"route {route.name!r} has a context of {route.max_model_len} tokens",
            )
        )
    return min(bounds, key=lambda b: b[0])


def check_prompt(
    num_prompt_tokens: int,
    limits: InputLimits,
    caps: RequestCaps = OFFLINE,
    is_pooling: bool = False,
) -> None:
    """Refuse a prompt over the route's ``max_input_tokens`` or one that leaves no room for
    output in the context (a pooling prompt may fill it)."""
    route = caps.route
    max_input = route.max_input_tokens if route is not None else None
    if route is not None and max_input is not None and num_prompt_tokens > max_input:
        raise ContextLengthError(
            f"route {route.name!r} allows prompts of at most {max_input} tokens; "
            f"this one has {num_prompt_tokens}",
            param="prompt",
            limit="max_input_tokens",
            value=num_prompt_tokens,
            bound=max_input,
        )
    max_len, context = context_of(limits, caps)
    if is_pooling:
        if num_prompt_tokens > max_len:
            raise ContextLengthError(
                f"{context}. However, the input has {num_prompt_tokens} tokens; reduce its "
                "length (or set truncate_prompt_tokens).",
                param="input",
                limit="context",
                value=num_prompt_tokens,
                bound=max_len,
            )
        return
    if num_prompt_tokens >= max_len:
        raise ContextLengthError(
            f"{context}. However, your prompt has {num_prompt_tokens} tokens, "
            "leaving no room for output.",
            param="prompt",
            limit="context",
            value=num_prompt_tokens,
            bound=max_len - 1,
        )


def max_output_tokens(
    num_prompt_tokens: int,
    params: SamplingParams,
    limits: InputLimits,
    caps: RequestCaps = OFFLINE,
) -> int:
    """How many tokens the request generates at most; raises where its ``max_tokens`` must
    fit and does not. The prompt passed ``check_prompt``."""
    max_len, context = context_of(limits, caps)
    room = max_len - num_prompt_tokens
    asked = params.max_tokens
    if asked is not None and asked > room and caps.max_tokens_must_fit:
        raise ContextLengthError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. {context} and "
            f"your request has {num_prompt_tokens} input tokens "
            f"({asked} > {max_len} - {num_prompt_tokens}).",
            param=caps.max_tokens_param,
            limit="context",
            value=asked,
            bound=room,
        )
    route_cap = caps.route.max_tokens if caps.route is not None else None
    return min(v for v in (room, asked, route_cap, caps.default_max_tokens) if v is not None)


def resolve(
    num_prompt_tokens: int,
    params: SamplingParams,
    limits: InputLimits,
    caps: RequestCaps = OFFLINE,
) -> SamplingParams:
    """``params`` with ``max_tokens`` set to what the request may generate (and ``min_tokens``
    no more than it); the same object when nothing changes."""
    max_tokens = max_output_tokens(num_prompt_tokens, params, limits, caps)
    if params.max_tokens == max_tokens:
        return params
    return params.clone(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
