"""GenerationRun over a scripted fake engine: the per-request metrics it records, and errors.

No server and no model: each test scripts the RequestOutputs an engine request yields and
reads the resulting Prometheus samples from the run's own ServerMetrics registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.entrypoints.openai.errors import to_api_error
from tokenmill.entrypoints.openai.generation import GenerationRun
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.metrics import ServerMetrics
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "demo"
PROMPT = [1, 2, 3]
STEP_S = 0.01


def _output(choices: list[tuple[list[int], list[int], str | None]]) -> RequestOutput:
    """One step's DELTA output (what the server asks for): per choice (all token ids so far,
    for the script's readability; the new ones, which the output carries; finish reason)."""
    completions = [
        CompletionOutput(
            index=i, text="", token_ids=list(delta), finish_reason=reason, token_ids_delta=delta
        )
        for i, (_, delta, reason) in enumerate(choices)
    ]
    finished = all(reason is not None for _, _, reason in choices)
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=None)
    return RequestOutput("r", None, PROMPT, completions, finished, metrics)


class ScriptedEngine:
    """Yields the scripted outputs a step apart; ``hang`` waits forever after them."""

    def __init__(
        self, script: list[RequestOutput], hang: bool = False, error: Exception | None = None
    ) -> None:
        self.script = script
        self.hang = hang
        self.error = error

    async def generate(self, request: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        assert (
            request.params.output_kind is RequestOutputKind.DELTA
        )  # the contract these scripts follow
        if self.error is not None:
            raise self.error
        for output in self.script:
            await asyncio.sleep(STEP_S)
            output.metrics.first_scheduled_time = request.arrival_time
            yield output
        if self.hang:
            await asyncio.Event().wait()


def _run(
    engine: ScriptedEngine, n: int, timeout_s: float = 30.0
) -> tuple[GenerationRun, ServerMetrics]:
    metrics = ServerMetrics(MODEL, 1024, lambda: None)
    state: Any = SimpleNamespace(
        engine=engine,
        config=ServerConfig(request_timeout_s=timeout_s),
        metrics=metrics,
        is_cut_off=False,
        active_runs=set(),
    )
    params = SamplingParams(n=n, max_tokens=16, output_kind=RequestOutputKind.DELTA)
    prompt = ProcessedRequest("cmpl-test-0", PROMPT, None, params, 0, time.monotonic())
    return GenerationRun(state, "cmpl-test", [prompt]), metrics


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(f"tokenmill:{name}", {"model_name": MODEL, **labels})
    return 0.0 if value is None else value


def test_n2_counts_once_and_times_each_choice() -> None:
    script = [
        _output([([5], [5], None), ([], [], None)]),
        _output([([5, 6], [6], None), ([7], [7], None)]),
        _output([([5, 6, 8], [8], "length"), ([7, 9], [9], "stop")]),
    ]
    run, metrics = _run(ScriptedEngine(script), n=2)
    (output,) = asyncio.run(run.collect())
    # The deltas are folded into one whole output per choice.
    assert [c.token_ids for c in output.outputs] == [[5, 6, 8], [7, 9]] and output.finished
    assert run.num_completion_tokens == 5
    assert _sample(metrics, "request_success_total", finished_reason="length") == 1
    assert _sample(metrics, "request_success_total", finished_reason="stop") == 0
    # One ITL per token-carrying output after a choice's first: 2 for choice 0, 1 for choice 1.
    assert _sample(metrics, "inter_token_latency_seconds_count") == 3
    assert _sample(metrics, "request_time_per_output_token_seconds_count") == 2
    # Choice 0: 3 tokens over two steps, so its TPOT is about one step.
    assert _sample(metrics, "request_time_per_output_token_seconds_sum") > STEP_S
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert _sample(metrics, f"{name}_count") == 1, name
    assert _sample(metrics, "request_generation_tokens_sum") == 5
    assert _sample(metrics, "request_prompt_tokens_sum") == len(PROMPT)
    assert run.ttft_s is not None and run.ttft_s >= STEP_S


def test_timed_out_request_still_records_e2e_as_length() -> None:
    script = [_output([([5], [5], None)]), _output([([5, 6], [6], None)])]
    run, metrics = _run(ScriptedEngine(script, hang=True), n=1, timeout_s=0.3)
    outputs = asyncio.run(run.collect())
    assert outputs[0] is not None and run.is_timed_out
    assert _sample(metrics, "request_success_total", finished_reason="length") == 1
    assert _sample(metrics, "e2e_request_latency_seconds_count") == 1
    assert _sample(metrics, "e2e_request_latency_seconds_sum") >= 0.3
    assert _sample(metrics, "request_time_per_output_token_seconds_count") == 1


@pytest.mark.parametrize("num_outputs", [0, 1])
def test_aborted_request_still_records_e2e(num_outputs: int) -> None:
    script = [_output([([5], [5], None)])][:num_outputs]
    run, metrics = _run(ScriptedEngine(script, hang=True), n=1)

    async def disconnect() -> None:
        task = asyncio.ensure_future(run.collect())
        await asyncio.sleep(0.2)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(disconnect())
    assert _sample(metrics, "request_success_total", finished_reason="abort") == 1
    assert _sample(metrics, "e2e_request_latency_seconds_count") == 1
    assert _sample(metrics, "time_to_first_token_seconds_count") == num_outputs
    assert _sample(metrics, "request_generation_tokens_sum") == num_outputs


def test_engine_refusal_is_a_400_naming_the_param_and_not_counted() -> None:
    refusal = InvalidRequestError(
        "token id 1000000 is outside the vocabulary", param="stop_token_ids"
    )
    run, metrics = _run(ScriptedEngine([], error=refusal), n=1)
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(run.collect())
    error = to_api_error(info.value)
    assert error.status_code == 400 and error.param == "stop_token_ids"
    assert _sample(metrics, "e2e_request_latency_seconds_count") == 0


class HandFedEngine:
    """An engine request whose outputs the test puts in by hand; records whether it was closed."""

    def __init__(self) -> None:
        self.outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.is_closed = False

    async def generate(self, request: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                yield await self.outputs.get()
        finally:
            self.is_closed = True


def test_a_cancel_that_lands_with_an_output_is_never_lost() -> None:
    """The client leaves in the very loop turn its next output arrives (asyncio.wait_for's race)."""

    async def scenario() -> tuple[bool, bool]:
        engine = HandFedEngine()
        run, _ = _run(engine, n=1)  # type: ignore[arg-type]
        consumer = asyncio.ensure_future(run.collect())
        engine.outputs.put_nowait(_output([([1], [1], None)]))
        for _ in range(5):  # the consumer is now waiting for the second output
            await asyncio.sleep(0)
        # The output and the cancel arrive together: whatever the consumer awaits must not
        # pick the output and drop the cancel (Python 3.11's wait_for did).
        engine.outputs.put_nowait(_output([([1, 2], [2], None)]))
        for _ in range(2):
            await asyncio.sleep(0)
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(consumer, 5)
        return consumer.cancelled(), engine.is_closed

    for _ in range(20):  # each round puts the cancel at the same point; any loss fails the test
        cancelled, closed = asyncio.run(scenario())
        assert cancelled and closed


def test_cut_off_answers_503_and_closes_the_engine_request() -> None:
    async def scenario() -> tuple[Exception | None, bool, int]:
        engine = HandFedEngine()
        run, _ = _run(engine, n=1)  # type: ignore[arg-type]
        consumer = asyncio.ensure_future(run.collect())
        engine.outputs.put_nowait(_output([([1], [1], None)]))
        while not run.state.active_runs:
            await asyncio.sleep(0)
        run.cut_off()
        error = None
        try:
            await asyncio.wait_for(consumer, 5)
        except Exception as exc:
            error = exc
        return error, engine.is_closed, len(run.state.active_runs)

    error, closed, num_active = asyncio.run(scenario())
    api_error = to_api_error(error, "cmpl-test")  # type: ignore[arg-type]
    assert api_error.status_code == 503 and "shutting down" in api_error.message
    assert closed and num_active == 0
