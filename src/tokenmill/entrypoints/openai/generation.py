"""GenerationRun: one HTTP request's engine requests, from tokenized prompts to choice deltas.

Owns what completions and chat share: tokenizing off the event loop, submitting one engine
request per prompt and merging their outputs, the ``--request-timeout`` deadline (partial
output finishes with ``length``; nothing produced yet is a 503), per-request metrics,
usage counts, and turning RequestOutputs into per-choice deltas for streaming. Closing a
run's iterator, which a client disconnect does, aborts every engine request it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.streaming import SSE_DONE, sse_event
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0
"""Stands in for -inf so the JSON stays valid (vLLM does the same)."""


class RequestTimeoutError(Exception):
    """The request outlived ``--request-timeout``."""


@dataclass
class PromptInput:
    """One prompt, tokenized; ``text`` is kept for ``echo``."""

    token_ids: list[int]
    text: str | None = None


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


async def tokenize_prompts(
    state: ServerState, prompts: list[str | list[int]], add_special_tokens: bool = True
) -> list[PromptInput]:
    """Tokenize and validate every prompt on a worker thread, so the event loop stays free."""
    engine = state.engine

    def work() -> list[PromptInput]:
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                inputs.append(PromptInput(ids, prompt))
            else:
                inputs.append(PromptInput(list(prompt)))
            engine.validate_prompt(inputs[-1].token_ids)
        return inputs

    return await asyncio.to_thread(work)


class GenerationRun:
    """The engine requests of one API request, merged, with a deadline and metrics."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompts: list[PromptInput],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        """When the HTTP request arrived, so TTFT and queue time include tokenization."""
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self.is_timed_out = False
        self._last_token_time: list[float | None] = [None] * len(prompts)
        self._itl_s: list[list[float]] = [[] for _ in prompts]
        self._is_observed = [False] * len(prompts)

    # ---- counts ------------------------------------------------------------------------
    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self.latest if out is not None for c in out.outputs)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def record_for_access_log(self, request: Request) -> None:
        """Token counts and TTFT for the access-log line of this HTTP request."""
        first = self.latest[0]
        ttft = first.metrics.ttft_s if first is not None else None
        request.scope.setdefault("state", {})["generation"] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "ttft_s": ttft,
        }

    # ---- outputs ---------------------------------------------------------------------------
    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as steps produce them; raises RequestTimeoutError at the deadline."""
        engine = self.state.engine
        deadline = self.arrival_time + self.state.config.request_timeout_s  # waiting counts too
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            stream = engine.generate(
                f"{self.request_id}-{index}", self.prompts[index].token_ids, self.params,
                self.priority, self.arrival_time,
            )
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
                timeout_s = deadline - time.monotonic()
                if timeout_s <= 0:
                    raise RequestTimeoutError()
                try:
                    index, item = await asyncio.wait_for(queue.get(), timeout_s)
                except asyncio.TimeoutError:
                    raise RequestTimeoutError() from None
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._record(index, item)
                    yield index, item
        except RequestTimeoutError:
            self.is_timed_out = True
            logger.info("request %s timed out after %.1fs", self.request_id, self.state.config.request_timeout_s)
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._observe_unfinished()

    async def collect(self) -> list[RequestOutput | None]:
        """Run to the end; on timeout, keep the partial outputs (a 503 if there are none)."""
        stream = self.outputs()
        try:
            async for _ in stream:
                pass
        except RequestTimeoutError:
            if self.num_completion_tokens == 0:
                raise APIError(503, "the request timed out before producing any output",
                               code="request_timeout") from None
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
                        batch.append(ChoiceDelta(index, c.text_delta, new_ids, logprobs, c.finish_reason, c.stop_reason))
                if batch:
                    yield batch
        except RequestTimeoutError:
            if self.num_completion_tokens == 0:
                raise APIError(503, "the request timed out before producing any output",
                               code="request_timeout") from None
            yield [ChoiceDelta(i, "", [], None, "length") for i in range(self.num_choices) if i not in finished]
        finally:
            await stream.aclose()

    # ---- metrics ---------------------------------------------------------------------------
    def _record(self, index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        if any(c.token_ids_delta for c in output.outputs):
            last = self._last_token_time[index]
            if last is not None:
                self._itl_s[index].append(now - last)
            self._last_token_time[index] = now
        self.latest[index] = output
        if output.finished:
            self._observe(index, output)

    def _observe(self, index: int, output: RequestOutput) -> None:
        if self._is_observed[index]:
            return
        self._is_observed[index] = True
        reasons = [c.finish_reason or ("length" if self.is_timed_out else "abort") for c in output.outputs]
        self.state.metrics.observe_finished(
            output.metrics, len(output.prompt_token_ids), reasons,
            sum(len(c.token_ids) for c in output.outputs), self._itl_s[index],
        )

    def _observe_unfinished(self) -> None:
        for index, output in enumerate(self.latest):
            if output is not None:
                self._observe(index, output)


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


def choice_logprob_entries(
    token_ids: list[int], entries: list[PositionLogprobs | None] | None, tokenizer: Any
) -> list[tuple[int, str, float | None, list[tuple[str, float]]]]:
    """(token id, token text, logprob, top (text, logprob) by rank) for each position."""
    rows = []
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            rows.append((token_id, tokenizer.id_to_token_text(token_id), None, []))
            continue
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else tokenizer.id_to_token_text(token_id)
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        top_rows = [
            (lp.decoded_token if lp.decoded_token is not None else tokenizer.id_to_token_text(t), finite_logprob(lp.logprob))
            for t, lp in top
        ]
        rows.append((token_id, text, finite_logprob(chosen.logprob) if chosen else None, top_rows))
    return rows
