"""GenerationRun: one HTTP request's engine requests, from tokenized prompts to choice deltas.

Owns what completions and chat share: parsing and checking the body up to admission
(``parse_request``), tokenizing off the event loop, submitting one engine request per
prompt and merging their outputs, the ``--request-timeout`` deadline (partial output
finishes with ``length``; nothing produced yet is a 503), per-request metrics timed on the
event loop from the outputs received, usage counts, turning RequestOutputs into per-choice
deltas, and answering with a stream or one JSON body (``respond``). Closing a run's
iterator, which a client disconnect does, aborts every engine request it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.engine.input_processor import CheckedParams, ProcessedRequest
from tokenmill.entrypoints.openai.admission import admit_sequences
from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.generation_config import (
    with_generation_defaults,
    with_server_defaults,
)
from tokenmill.entrypoints.openai.protocol import RequestBody, decode_json_object, validate_model
from tokenmill.entrypoints.openai.request_log import log_output, log_prompts
from tokenmill.entrypoints.openai.routes import (
    check_route_body,
    grow_route,
    route_body,
    route_prompts,
)
from tokenmill.entrypoints.openai.state import ServerState, get_state, new_request_id
from tokenmill.entrypoints.openai.streaming import (
    SSE_DONE,
    ClientDisconnected,
    SSEResponse,
    run_until_disconnected,
    sse_event,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics import ChoiceTiming, RequestTiming
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.structured.grammar import CompiledGrammar

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0
"""Stands in for -inf so the JSON stays valid (vLLM does the same)."""

BodyT = TypeVar("BodyT", bound=RequestBody)


class RequestTimeoutError(Exception):
    """The request outlived ``--request-timeout``."""


class ServerShuttingDownError(APIError):
    """The drain's ``--shutdown-timeout`` ran out while this request was still running."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the server is shutting down; the request was cut off before it finished",
            headers={"Retry-After": "1"},
        )


_TIMED_OUT = object()
"""Queue item the deadline timer puts into a run's queue."""
_CUT_OFF = object()
"""Queue item ``GenerationRun.cut_off`` puts into a run's queue."""
_QueueItem = Any
"""``(prompt index, output | error | None when that engine request ended)``, or a sentinel."""


@dataclass
class ChoiceDelta:
    """What one choice gained since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


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
        check_route_body(request, body),
        state.generation_defaults,
        state.config.enable_force_include_usage,
    )
    model = state.resolve_model(body.model)
    state.ready_engine()
    return ParsedRequest(
        request, state, request_id, arrival_time, body, model, lora_request=state.lora_for(model)
    )


def check_params(
    state: ServerState,
    params: SamplingParams,
    priority: int,
    lora_request: LoRARequest | None = None,
    grammar: CompiledGrammar | None = None,
) -> CheckedParams:
    """The input processor's one check of what a request's prompts share; outputs stream as deltas."""
    return state.engine.input_processor.check_params(
        params.clone(output_kind=RequestOutputKind.DELTA), priority, lora_request, grammar
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
    processor = state.engine.input_processor
    timeout_s = state.config.grammar_compile_timeout_s
    compiler = processor.grammar_compiler
    compiled = compiler.cached(params.structured_outputs) if compiler is not None else None
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
        return processor.compile_grammar(params)

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
    tokenization, processor = state.tokenization, state.engine.input_processor
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
            request = processor.process_prompt(
                f"{req.request_id}-{i}", ids, checked, req.arrival_time
            )
            processed.append(
                replace(request, prompt_text=prompt) if isinstance(prompt, str) else request
            )
        return processed

    processed = route_prompts(req.http, await tokenization.run(work))
    if state.config.enable_log_requests:
        log_prompts(processed, state.config.max_log_len)
    return processed


class GenerationRun:
    """The engine requests of one API request, merged, with a deadline and metrics."""

    def __init__(
        self, state: ServerState, request_id: str, prompts: list[ProcessedRequest]
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.prompts = prompts
        """One checked engine request per prompt; they share their parameters and arrival time."""
        self.params = prompts[0].params
        lora = prompts[0].lora_request
        self.lora_name = lora.lora_name if lora is not None else None
        """The adapter it runs with, for per-adapter metrics and the access log."""
        self.arrival_time = prompts[0].arrival_time
        """When the HTTP request arrived, so TTFT and queue time include tokenization."""
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self.is_timed_out = False
        self._timings = [[ChoiceTiming() for _ in range(self.params.n)] for _ in prompts]
        """Per prompt, per choice: when its tokens reached the server (event-loop clock)."""
        self._is_observed = [False] * len(prompts)
        self._engine_error: BaseException | None = None
        self._queue: asyncio.Queue[_QueueItem] | None = None

    # ---- counts ------------------------------------------------------------------------
    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self.latest if out is not None for c in out.outputs)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV the prefix cache served (as first scheduled)."""
        return sum(out.num_cached_tokens for out in self.latest if out is not None)

    def usage(self) -> dict[str, Any]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.state.config.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    @property
    def ttft_s(self) -> float | None:
        """From arrival to the first token of any choice reaching the server."""
        times = [
            t.first_token_time
            for choices in self._timings
            for t in choices
            if t.first_token_time is not None
        ]
        return min(times) - self.arrival_time if times else None

    def record_for_access_log(self, request: Request) -> None:
        """Token counts and TTFT for the access-log line of this HTTP request."""
        ttft = self.ttft_s
        request.scope.setdefault("state", {})["generation"] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "ttft_s": ttft,
            "lora": self.lora_name,
        }

    # ---- outputs ---------------------------------------------------------------------------
    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) as steps produce them.

        Raises RequestTimeoutError at the deadline and ServerShuttingDownError when the drain
        cuts the run off. Both arrive as items in the run's one queue, so the loop awaits a
        plain ``queue.get()``: ``asyncio.wait_for`` around it would swallow a cancellation
        (a client that left) that lands in the turn the item arrives (Python < 3.12).
        """
        engine = self.state.engine
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queue = queue
        if self.state.is_cut_off:
            raise ServerShuttingDownError()
        self.state.active_runs.add(self)
        # The deadline counts waiting too: it runs from the request's arrival.
        remaining_s = self.arrival_time + self.state.config.request_timeout_s - time.monotonic()
        timer = asyncio.get_running_loop().call_later(
            max(remaining_s, 0.0), queue.put_nowait, _TIMED_OUT
        )

        async def pump(index: int) -> None:
            stream = engine.generate(self.prompts[index])
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                await stream.aclose()  # aborts the engine request if it is unfinished
                queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.prompts))]
        remaining = len(tasks)
        try:
            while remaining:
                entry = await queue.get()
                if entry is _TIMED_OUT:
                    raise RequestTimeoutError()
                if entry is _CUT_OFF:
                    raise ServerShuttingDownError()
                index, item = entry
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    self._engine_error = item
                    raise item
                else:
                    self._record(index, item)
                    yield index, item
        except RequestTimeoutError:
            self.is_timed_out = True
            logger.info(
                "request %s timed out after %.1fs",
                self.request_id,
                self.state.config.request_timeout_s,
            )
            raise
        finally:
            timer.cancel()
            self.state.active_runs.discard(self)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._observe_unfinished()

    def cut_off(self) -> None:
        """End this run now (the drain's time is up): it answers 503 and aborts its engine requests."""
        if self._queue is not None:
            self._queue.put_nowait(_CUT_OFF)

    async def collect(self) -> list[RequestOutput | None]:
        """Run to the end; on timeout, keep the partial outputs (a 503 if there are none)."""
        stream = self.outputs()
        try:
            async for _ in stream:
                pass
        except RequestTimeoutError:
            if self.num_completion_tokens == 0:
                raise APIError(
                    503, "the request timed out before producing any output", code="request_timeout"
                ) from None
        finally:
            await stream.aclose()
        return self.latest

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Per-choice deltas for streaming; a timeout finishes open choices with ``length``."""
        n = self.params.n
        finished: set[int] = set()
        stream = self.outputs()
        try:
            async for prompt_index, output in stream:
                batch = []
                for c in output.outputs:
                    index = prompt_index * n + c.index
                    if index in finished:
                        continue
                    new_ids = list(c.token_ids_delta)
                    logprobs = None
                    if c.logprobs is not None:
                        end = len(c.token_ids)
                        logprobs = c.logprobs[end - len(new_ids) : end]
                    if c.finish_reason is not None:
                        finished.add(index)
                    # One delta per token, even while its text is held back (as vLLM streams).
                    if c.text_delta or new_ids or c.finish_reason is not None:
                        batch.append(
                            ChoiceDelta(
                                index,
                                c.text_delta,
                                new_ids,
                                logprobs,
                                c.finish_reason,
                                c.stop_reason,
                            )
                        )
                if batch:
                    yield batch
        except RequestTimeoutError:
            if self.num_completion_tokens == 0:
                raise APIError(
                    503, "the request timed out before producing any output", code="request_timeout"
                ) from None
            yield [
                ChoiceDelta(i, "", [], None, "length")
                for i in range(self.num_choices)
                if i not in finished
            ]
        finally:
            await stream.aclose()

    # ---- metrics ---------------------------------------------------------------------------
    def _record(self, index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        timings = self._timings[index]
        for c in output.outputs:
            if not c.token_ids_delta:
                continue
            timing = timings[c.index]
            if timing.last_token_time is None:
                timing.first_token_time = now
            else:
                self.state.metrics.observe_inter_token_latency(now - timing.last_token_time)
            timing.last_token_time = now
            timing.num_tokens += len(c.token_ids_delta)
        # The engine sends deltas (cheap per step); ``latest`` accumulates them.
        previous = self.latest[index]
        if previous is None:
            self.latest[index] = output.copy()
        else:
            previous.add(output)
        if output.finished:
            self._observe(index, now)

    def _observe(self, index: int, end_time: float) -> None:
        """Record engine request ``index`` once, finished or cut short (abort, timeout)."""
        if self._is_observed[index]:
            return
        self._is_observed[index] = True
        output = self.latest[index]
        timings = self._timings[index]
        first = output.outputs[0] if output is not None and output.outputs else None
        reason = first.finish_reason if first is not None else None
        if reason is None:  # cut short: a timed-out choice with output is answered as "length"
            reason = "length" if self.is_timed_out and timings[0].num_tokens else "abort"
        config = self.state.config
        if config.enable_log_outputs and output is not None:
            for c in output.outputs:
                log_output(
                    self.prompts[index].request_id,
                    c.index,
                    c.text,
                    c.token_ids,
                    c.finish_reason or reason,
                    config.max_log_len,
                )
        if self.lora_name is not None:
            self.state.metrics.observe_lora(
                self.lora_name,
                len(self.prompts[index].prompt_token_ids),
                sum(t.num_tokens for t in timings),
            )
        self.state.metrics.observe_finished(
            RequestTiming(
                arrival_time=self.arrival_time,
                end_time=end_time,
                num_prompt_tokens=len(self.prompts[index].prompt_token_ids),
                finished_reason=reason,
                choices=timings,
                # Set once by the engine thread before the first output; read, never written, here.
                first_scheduled_time=output.metrics.first_scheduled_time
                if output is not None
                else None,
                n=self.params.n,
                max_tokens=self.params.max_tokens,
                num_cached_tokens=output.num_cached_tokens if output is not None else 0,
                num_preemptions=output.metrics.num_preemptions if output is not None else 0,
            )
        )

    def _observe_unfinished(self) -> None:
        now = time.monotonic()
        for index, output in enumerate(self.latest):
            # An engine request refused with an error before any output was never served.
            if output is None and self._engine_error is not None:
                continue
            self._observe(index, now)


# ---- responding: one JSON body, or a stream of chunks ------------------------------------------
class ChunkWriter:
    """The SSE chunks of one stream: the shared envelope, and the usage a chunk may carry."""

    def __init__(self, req: ParsedRequest[Any], run: GenerationRun, object_name: str) -> None:
        self.req = req
        self.run = run
        self.object_name = object_name

    def __call__(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        """A chunk of these choices (with the running usage if ``continuous_usage_stats``),
        plus ``extra`` top-level fields (vLLM's ``prompt_token_ids``, ``prompt_logprobs``)."""
        usage = self.run.usage() if self.req.body.continuous_usage else None
        return self._event(choices, usage, extra)

    def usage(self) -> bytes:
        """The final chunk ``include_usage`` asks for: no choices, the request's usage."""
        return self._event([], self.run.usage())

    def _event(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        req = self.req
        payload: dict[str, Any] = {
            "id": req.request_id,
            "object": self.object_name,
            "created": req.created,
            "model": req.model,
            "choices": choices,
            **(extra or {}),
        }
        if usage is not None:
            payload["usage"] = usage
        return sse_event(payload)


async def respond(
    req: ParsedRequest[Any],
    run: GenerationRun,
    object_name: str,
    stream: Callable[[], AsyncIterator[bytes]],
    build_choices: Callable[[list[RequestOutput | None]], list[dict[str, Any]]],
    build_extra: Callable[[list[RequestOutput | None]], dict[str, Any]] | None = None,
) -> Response:
    """Stream ``stream()``'s chunks, or run to the end and answer the choices in one body.

    A client that disconnects before a plain body is ready gets 499 (nginx's code), which
    only the access log sees.
    """
    request = req.http
    if req.body.stream:
        events = guard_stream(
            stream(), req.request_id, on_close=lambda: run.record_for_access_log(request)
        )
        return SSEResponse(events, headers=req.headers)
    try:
        outputs = await run_until_disconnected(request, run.collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        run.record_for_access_log(request)
    return JSONResponse(
        {
            "id": req.request_id,
            "object": object_name,
            "created": req.created,
            "model": req.model,
            "choices": build_choices(outputs),
            "usage": run.usage(),
            "system_fingerprint": None,
            **(build_extra(outputs) if build_extra is not None else {}),
        },
        headers=req.headers,
    )


async def guard_stream(
    events: AsyncIterator[bytes], request_id: str, on_close: Callable[[], None] | None = None
) -> AsyncIterator[bytes]:
    """Pass SSE events through; any error becomes an error event, and ``[DONE]`` always ends it."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = to_api_error(exc, request_id)
        if error.status_code >= 500 and not isinstance(exc, APIError):
            logger.error("stream %s failed: %s", request_id, error.message, exc_info=exc)
        yield sse_event(error.body())
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
        if on_close is not None:
            on_close()
    yield SSE_DONE


def token_label(token_id: int, text: str, as_token_ids: bool) -> str:
    """How a logprob entry names its token: its text, or vLLM's ``token_id:N`` when the
    request set ``return_tokens_as_token_ids`` (exact ids, whatever the detokenizer does)."""
    return f"token_id:{token_id}" if as_token_ids else text


def choice_logprob_entries(
    token_ids: list[int], entries: Sequence[PositionLogprobs | None] | None, tokenizer: Any
) -> list[tuple[int, str, float | None, list[tuple[int, str, float]]]]:
    """(token id, token text, logprob, top (id, text, logprob) by rank) for each position."""
    rows: list[tuple[int, str, float | None, list[tuple[int, str, float]]]] = []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            rows.append((token_id, tokenizer.id_to_token_text(token_id), None, []))
            continue
        chosen = entry.get(token_id)
        text = (
            chosen.decoded_token
            if chosen and chosen.decoded_token is not None
            else tokenizer.id_to_token_text(token_id)
        )
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        top_rows = [
            (
                t,
                lp.decoded_token if lp.decoded_token is not None else tokenizer.id_to_token_text(t),
                finite_logprob(lp.logprob),
            )
            for t, lp in top
        ]
        rows.append((token_id, text, finite_logprob(chosen.logprob) if chosen else None, top_rows))
    return rows
