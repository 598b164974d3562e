"""AsyncLLMEngine: runs the single-threaded LLMEngine on its own thread for an asyncio server.

Owns the hand-off between the two worlds. The asyncio side never touches the engine's
mutable state: it submits add/abort commands through a thread-safe queue, and the engine
thread hands each step's outputs back with ``loop.call_soon_threadsafe`` into one asyncio
queue per request. So the model step never blocks the event loop, an abort (a client that
went away) is applied before the next step, a request whose own processing raised gets
its error while the rest go on, and a crashed engine is marked dead and fails every
in-flight request instead of leaving it waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.stats import EngineStats, StartupCosts
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.engine.input_processor import CheckedParams, ProcessedRequest
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request_limits import OFFLINE, RequestCaps
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.structured.grammar import CompiledGrammar

logger = logging.getLogger(__name__)


class EngineDeadError(TokenmillError):
    """The engine thread crashed, failed to load or was shut down: nothing can be served."""


class EngineNotReadyError(TokenmillError):
    """The model is still loading."""


class EngineState(enum.Enum):
    """Life cycle of the engine thread, as the server reports it on /health."""

    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class _AddCommand:
    request: ProcessedRequest


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass
class _RemoveLoRACommand:
    lora_id: int


class _StopCommand:
    pass


_Command = _AddCommand | _AbortCommand | _RemoveLoRACommand | _StopCommand


def _shutdown_workers(engine: LLMEngine) -> None:
    """Stop the engine's worker processes (a stand-in engine may have none)."""
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()


class AsyncLLMEngine:
    """An LLMEngine driven by a background thread, fed and drained from asyncio."""

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine,
        idle_wait_s: float = 1.0,
        step_gate: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self._idle_wait_s = idle_wait_s
        self._step_gate = step_gate
        """Called on the engine thread before each step; commands that arrive while it
        blocks are applied before that step. Tests hand out steps with it."""
        self._engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready_event: asyncio.Event | None = None
        self._stats = EngineStats()
        self.state = EngineState.CREATED
        self.error: BaseException | None = None
        """Why the engine died, for logs (never shown to clients)."""

    # ---- life cycle (called on the event loop) ---------------------------------------
    def start(self) -> None:
        """Start loading the model on the engine thread; returns at once."""
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._loop = asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        self.state = EngineState.LOADING
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raises EngineDeadError if loading failed."""
        if self._ready_event is None:
            raise RuntimeError("start() the engine first")
        await self._ready_event.wait()
        if self.state is not EngineState.READY:
            raise EngineDeadError("the engine failed to start")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests fail with EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_StopCommand())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1fs", timeout_s)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        # Streams belong to the event loop; this may be called from a worker thread.
        self._call_on_loop(self._fail_all_streams, "the engine was shut down")

    @property
    def is_ready(self) -> bool:
        """True when requests can be served (loaded and not dead)."""
        return self.state is EngineState.READY

    @property
    def failed_to_load(self) -> bool:
        """True when the model never loaded (the server should exit, not wait)."""
        return self.state is EngineState.DEAD and self._engine is None

    # ---- read-only views of the loaded engine ------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The wrapped engine; only its immutable parts may be used off the engine thread."""
        if self._engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe for encode/decode/templates)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this (the model's embedding rows)."""
        return self.engine.model_config.vocab_size

    # ---- checking requests (the input processor is immutable: safe on any thread) ------
    def check_params(
        self,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        grammar: CompiledGrammar | None = None,
        caps: RequestCaps = OFFLINE,
        pooling: PoolingParams | None = None,
        cache_salt: str | None = None,
    ) -> CheckedParams:
        """Check what a request's prompts share against the engine's limits and ``caps``
        (a ``RequestLimitError`` names what is over); ``pooling`` makes it a pooling request,
        ``cache_salt`` its prefix-cache namespace."""
        checked = self.engine.input_processor.check_params(
            params, priority, lora_request, grammar, caps, cache_salt
        )
        return checked if pooling is None else dataclasses.replace(checked, pooling=pooling)

    def process_prompt(
        self,
        request_id: str,
        prompt: str | list[int],
        checked: CheckedParams,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Check one prompt of a checked request: what ``generate`` takes, ``max_tokens``
        resolved for it."""
        return self.engine.input_processor.process_prompt(request_id, prompt, checked, arrival_time)

    def cached_grammar(self, constraint: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar of ``constraint`` if it was compiled before (no work), else None."""
        compiler = self.engine.input_processor.grammar_compiler
        return compiler.cached(constraint) if compiler is not None else None

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile ``params.structured_outputs`` (slow: call it off the event loop)."""
        return self.engine.input_processor.compile_grammar(params)

    @property
    def stats(self) -> EngineStats:
        """The latest counters and gauges the engine thread published."""
        return self._stats

    @property
    def startup_costs(self) -> StartupCosts | None:
        """What loading cost (set once before READY, never changed); None while loading."""
        return self._engine.startup if self._engine is not None else None

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, request: ProcessedRequest) -> AsyncGenerator[RequestOutput, None]:
        """Submit a checked request (``process_prompt``) and yield its outputs as
        steps produce them.

        Closing or cancelling the iterator before the final output aborts the request; the
        abort reaches the engine before its next step, which frees the request's KV blocks.
        """
        self._check_serving()
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", param="request_id"
            )
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(_AddCommand(request))
        is_done = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                is_done = item.finished
                yield item
                if is_done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not is_done:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests wherever they are (no-op for unknown or finished ones)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self.state is EngineState.READY:
            self._commands.put(_AbortCommand(ids))

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter: its requests in flight finish with it, then its memory is freed
        (``LLMEngine.remove_lora``); requests naming it that reach the engine later fail."""
        if self.state is EngineState.READY:
            self._commands.put(_RemoveLoRACommand(lora_id))

    @property
    def num_streams(self) -> int:
        """Requests submitted through generate() and not yet finished."""
        return len(self._streams)

    def _check_serving(self) -> None:
        if self.state is EngineState.READY:
            return
        if self.state in (EngineState.CREATED, EngineState.LOADING):
            raise EngineNotReadyError("the model is still loading")
        raise EngineDeadError("the engine is not running")

    # ---- event-loop side of the hand-off --------------------------------------------------
    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _dispatch_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all_streams(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.put_nowait(EngineDeadError(message))

    def _mark_ready(self) -> None:
        if self._ready_event is not None:
            self._ready_event.set()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._engine_factory(self.config)
        except BaseException as exc:  # one line; the traceback under --log-level debug
            logger.error(
                "the engine failed to load: %s",
                exc if isinstance(exc, TokenmillError) else f"{type(exc).__name__}: {exc}",
                exc_info=exc if logger.isEnabledFor(logging.DEBUG) else None,
            )
            self.error = exc
            self.state = EngineState.DEAD
            self._call_on_loop(self._mark_ready)
            return
        self._engine = engine
        self._publish_stats(engine)
        self.state = EngineState.READY
        self._call_on_loop(self._mark_ready)
        try:
            self._loop_forever(engine)
        except BaseException as exc:
            logger.exception(
                "the engine step failed; the engine is dead and in-flight requests fail"
            )
            self.error = exc
            self.state = EngineState.DEAD
            self._call_on_loop(self._fail_all_streams, "the engine failed")
            _shutdown_workers(engine)  # the ranks still alive exit too
            return
        _shutdown_workers(engine)
        self.state = EngineState.STOPPED
        self._call_on_loop(self._fail_all_streams, "the engine was shut down")

    def _loop_forever(self, engine: LLMEngine) -> None:
        # An engine factory may build a stand-in without workers (tests): nothing to watch.
        check_health = getattr(engine, "check_health", lambda: None)
        while True:
            check_health()  # a worker process that died while idle ends the loop too
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            is_stopped, needs_flush = self._apply(engine, commands)
            if is_stopped:
                return
            # An abort's final output is only collected by a step; an empty step is cheap.
            if engine.has_unfinished_requests() or needs_flush:
                if self._step_gate is not None:
                    self._step_gate()
                    is_stopped, more_flush = self._apply(engine, self._take_commands(block=False))
                    if is_stopped:
                        return
                    needs_flush |= more_flush
                outputs = engine.step()
                if outputs:
                    self._call_on_loop(self._dispatch, outputs)
                for request_id, exc in engine.take_failures().items():
                    self._call_on_loop(self._dispatch_error, request_id, exc)
            self._publish_stats(engine)

    def _apply(self, engine: LLMEngine, commands: list[_Command]) -> tuple[bool, bool]:
        """Apply commands in order; returns (stop was asked, something was aborted)."""
        needs_flush = False
        for command in commands:
            if isinstance(command, _StopCommand):
                return True, needs_flush
            if isinstance(command, _AddCommand):
                self._add(engine, command)
            elif isinstance(command, _RemoveLoRACommand):
                engine.remove_lora(command.lora_id)
            else:
                engine.abort_request(command.request_ids)
                needs_flush = True
        return False, needs_flush

    def _take_commands(self, block: bool) -> list[_Command]:
        try:
            first = (
                self._commands.get(timeout=self._idle_wait_s)
                if block
                else self._commands.get_nowait()
            )
        except queue.Empty:
            return []
        commands = [first]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, engine: LLMEngine, command: _AddCommand) -> None:
        try:
            engine.add_processed(command.request)
        except Exception as exc:  # reported to that request alone; the engine is unchanged
            self._call_on_loop(self._dispatch_error, command.request.request_id, exc)

    def _publish_stats(self, engine: LLMEngine) -> None:
        self._stats = engine.stats  # a fresh snapshot, handed to the event loop
