"""GenerationRun: one HTTP request's engine requests, from tokenized prompts to choice deltas.

Owns what completions and chat share once the prompts are tokenized: submitting one engine
request per prompt and merging their outputs, the ``--request-timeout`` deadline (partial
output finishes with ``length``; nothing produced yet is a 503), per-request metrics timed
on the event loop from the outputs received, usage counts, and turning RequestOutputs into
per-choice deltas. Closing a run's iterator, which a client disconnect does, aborts every
engine request it started. Parsing lives in ``generation_request``, answering in
``generation_response``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.request_log import log_output
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.streaming import run_until_disconnected
from tokenmill.metrics import ChoiceTiming, RequestTiming
from tokenmill.outputs import PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)


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
            "prompt_token_ids": self.prompts[0].prompt_token_ids if self.prompts else None,
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

    async def collect_for(self, request: Request) -> list[RequestOutput | None]:
        """``collect()`` unless ``request``'s client leaves first, then ClientDisconnected.

        The app answers ClientDisconnected with 499 (nginx's code), which only the access
        log sees; the access log gets this run's counts either way.
        """
        try:
            return await run_until_disconnected(request, self.collect())
        finally:
            self.record_for_access_log(request)

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
                max_tokens=self.prompts[index].params.max_tokens,
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
