"""Parsing a generation request: what every generation endpoint checks before its own work.

Decoding and checking the body up to admission (``parse_request``), the engine's one check
of the shared parameters under the request's caps (the server's and its route's), compiling the output constraint on the grammar pool,
and tokenizing the prompts off the event loop (``process_prompts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from starlette.requests import Request

from tokenmill.core.cache_salt import compose_salt
from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.engine.input_processor import CheckedParams, ProcessedRequest
from tokenmill.engine.request_limits import RequestCaps
from tokenmill.entrypoints.openai.admission import admit_sequences
from tokenmill.entrypoints.openai.generation_config import (
    with_generation_defaults,
    with_server_defaults,
)
from tokenmill.entrypoints.openai.protocol import RequestBody, decode_json_object, validate_model
from tokenmill.entrypoints.openai.request_log import log_prompts
from tokenmill.entrypoints.openai.routes import (
    charge_route_input,
    grow_route,
    route_body,
    route_caps,
    with_route_priority,
)
from tokenmill.entrypoints.openai.state import ServerState, get_state, new_request_id
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.structured.grammar import CompiledGrammar

BodyT = TypeVar("BodyT", bound=RequestBody)

API_CAPS = RequestCaps(max_tokens_must_fit=True)
"""An API request's caps off any route, without a generation config cap."""


# ---- parsing: what both endpoints check before their own work ---------------------------------
@dataclass
class ParsedRequest(Generic[BodyT]):
    """A generation request whose body passed every check that needs no tokenizing."""

    http: Request
    state: ServerState
    request_id: str
    arrival_time: float
    """When the HTTP request arrived (time.monotonic), so TTFT and queue time include parsing."""
    body: BodyT
    model: str
    """The served model name the request addressed, echoed in the response."""
    created: int = field(default_factory=lambda: int(time.time()))
    lora_request: LoRARequest | None = None
    """The adapter ``model`` names; None for the base model."""
    caps: RequestCaps = API_CAPS
    """What the server and the request's route add to the engine's limits."""
    cache_salt: str | None = None
    """The prefix-cache namespace of its prompts: its API key's and its ``cache_salt``."""

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}

    def admit(self, num_prompts: int, n: int, is_beam: bool = False) -> None:
        """Hold this request's ``num_prompts * n`` sequences (400 if they never fit, 429 if
        not now); a beam search holds a place in the beam bound instead."""
        grow_route(self.http, num_prompts, n)
        admit_sequences(self.http, num_prompts, n, is_beam)


async def parse_request(
    request: Request,
    body_cls: type[BodyT],
    id_prefix: str,
    translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    runner: str = "generate",
) -> ParsedRequest[BodyT]:
    """Decode and check the body, resolve the model and check the engine can take it now.

    ``translate`` maps another API's body (Anthropic's Messages, OpenAI's Responses) onto
    ``body_cls``'s fields first; ``runner`` is what the route needs the engine to run.
    """
    arrival_time = time.monotonic()
    state = get_state(request)
    state.require_runner(runner, request.url.path)
    request_id = new_request_id(id_prefix, request.headers.get("x-request-id"))
    request.scope.setdefault("state", {})["request_id"] = request_id
    data = decode_json_object(await request.body(), request.headers.get("content-type"))
    if translate is not None:
        data = translate(data)
    sent = set(data)
    data = with_generation_defaults(route_body(request, data), state.generation_defaults)
    if state.config.return_tokens_as_token_ids:
        data.setdefault("return_tokens_as_token_ids", True)
    # Route and server defaults mean nothing to a body without such fields (embeddings).
    data = {k: v for k, v in data.items() if k in sent or k in body_cls.model_fields}
    body = validate_model(body_cls, data)
    body.check()
    body = with_server_defaults(
        with_route_priority(request, body), state.config.enable_force_include_usage
    )
    model = state.resolve_model(body.model)
    state.ready_engine()
    return ParsedRequest(
        request,
        state,
        request_id,
        arrival_time,
        body,
        model,
        lora_request=state.lora_for(model),
        caps=request_caps(request, state, body),
        cache_salt=request_cache_salt(request, state, getattr(body, "cache_salt", None)),
    )


def request_cache_salt(request: Request, state: ServerState, client_salt: str | None) -> str | None:
    """The request's prefix-cache namespace: the client's ``cache_salt`` (vLLM's field), under
    its API key's salt unless ``--share-prefix-cache-across-api-keys``. So, by default, no key
    hits blocks another key computed, and within a key only equal client salts share."""
    key_salt = request.scope.get("state", {}).get("api_key_salt")
    if state.config.share_prefix_cache_across_api_keys:
        key_salt = None
    return compose_salt(("api_key", key_salt), ("client", client_salt))


def request_caps(request: Request, state: ServerState, body: Any) -> RequestCaps:
    """The server's and the route's bounds on this request, as the engine applies them: a
    ``max_tokens`` the body carries must fit the context (vLLM's API servers refuse it),
    the generation config's ``max_new_tokens`` caps it."""
    is_completion_tokens = getattr(body, "max_completion_tokens", None) is not None
    return RequestCaps(
        route=route_caps(request),
        default_max_tokens=state.generation_defaults.get("max_tokens"),
        max_tokens_must_fit=True,
        max_tokens_param="max_completion_tokens" if is_completion_tokens else "max_tokens",
    )


def check_params(
    req: ParsedRequest[Any],
    params: SamplingParams,
    priority: int,
    grammar: CompiledGrammar | None = None,
) -> CheckedParams:
    """The engine's one check of what a request's prompts share, under the request's caps;
    outputs stream as deltas."""
    return req.state.engine.check_params(
        params.clone(output_kind=RequestOutputKind.DELTA),
        priority,
        req.lora_request,
        grammar,
        req.caps,
        cache_salt=req.cache_salt,
    )


async def compile_grammar(
    state: ServerState, params: SamplingParams, field: str
) -> CompiledGrammar | None:
    """Compile the request's output constraint on the grammar pool, within the time budget.

    The budget runs from when the compile starts: waiting for a turn on the pool (bounded
    by ``--max-concurrent-grammar-compiles``) does not count, and a request that leaves
    while it waits takes its compile off the queue. A compile that overruns is answered 400
    at once; its thread finishes in the background (llguidance's fuel limits bound it).
    Errors name ``field``, the body field the client used.
    """
    if params.structured_outputs is None:
        return None
    engine = state.engine
    timeout_s = state.config.grammar_compile_timeout_s
    compiled = engine.cached_grammar(params.structured_outputs)
    if compiled is not None:  # no turn on the pool needed
        return compiled
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()

    def mark_started() -> None:
        if not started.done():
            started.set_result(None)

    def work() -> CompiledGrammar | None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(mark_started)
        return engine.compile_grammar(params)

    future = state.grammar_pool.submit(work)
    result = asyncio.wrap_future(future)
    try:
        waiting: set[asyncio.Future[Any]] = {started, result}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        future.cancel()  # still queued: it never runs
        raise
    try:
        return await asyncio.wait_for(asyncio.shield(result), timeout_s)
    except asyncio.TimeoutError:
        raise InvalidRequestError(
            f"the {params.structured_outputs.kind} constraint took longer than {timeout_s:g}s to compile",
            param=field,
        ) from None
    except InvalidRequestError as exc:
        exc.param = field
        raise


async def process_prompts(
    req: ParsedRequest[Any],
    prompts: list[str | list[int]],
    checked: CheckedParams,
    add_special_tokens: bool = True,
) -> list[ProcessedRequest]:
    """Tokenize and check every prompt on the tokenizing pool, so the event loop stays free.

    Engine request ``i`` is ``<request id>-i``; text prompts keep their text for ``echo``.
    """
    state = req.state
    tokenization, engine = state.tokenization, state.engine
    for prompt in prompts:  # refuse what cannot fit before tokenizing any of it
        if isinstance(prompt, str):
            tokenization.check_length(prompt)

    def work() -> list[ProcessedRequest]:
        processed = []
        for i, prompt in enumerate(prompts):
            ids = (
                tokenization.encode(prompt, add_special_tokens)
                if isinstance(prompt, str)
                else list(prompt)
            )
            request = engine.process_prompt(f"{req.request_id}-{i}", ids, checked, req.arrival_time)
            processed.append(
                replace(request, prompt_text=prompt) if isinstance(prompt, str) else request
            )
        return processed

    processed = await tokenization.run(work)
    charge_route_input(req.http, processed)
    if state.config.enable_log_requests:
        log_prompts(processed, state.config.max_log_len)
    return processed
