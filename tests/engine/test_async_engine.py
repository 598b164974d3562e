"""AsyncLLMEngine over a fake engine: streaming, aborts on cancel, errors and engine death."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tokenmill.config import EngineConfig
from tokenmill.core.kv.base import KVCacheStats
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.stats import EngineStats
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineState
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FakeEngine:
    """One token per request per step; ``[666]`` is an invalid prompt."""

    def __init__(self, config: EngineConfig) -> None:
        self.progress: dict[str, tuple[int, int]] = {}
        self.aborted: list[str] = []
        self._finished: list[str] = []
        self.should_fail = False
        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)
        self.kv_manager = SimpleNamespace(usage=0.0, stats=KVCacheStats())

    def add_processed(self, request: ProcessedRequest) -> None:
        if request.prompt_token_ids == [666]:
            raise InvalidRequestError("bad prompt", param="prompt")
        self.progress[request.request_id] = (0, request.params.max_tokens)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.progress.pop(rid, None) is not None:
                self.aborted.append(rid)
                self._finished.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.progress)

    def _output(self, rid: str, num_done: int, reason: str | None) -> RequestOutput:
        delta = [] if reason == "abort" else [num_done]
        completion = CompletionOutput(
            index=0,
            text="x" * num_done,
            token_ids=list(range(num_done)),
            finish_reason=reason,
            text_delta="" if reason == "abort" else "x",
            token_ids_delta=delta,
        )
        return RequestOutput(
            rid, None, [1], [completion], reason is not None, RequestMetrics(time.monotonic())
        )

    def take_failures(self) -> dict[str, Exception]:
        return {}

    def step(self) -> list[RequestOutput]:
        if self.should_fail:
            raise RuntimeError("boom")
        time.sleep(0.005)
        outputs = [self._output(rid, 0, "abort") for rid in self._finished]
        self._finished = []
        for rid, (done, total) in list(self.progress.items()):
            done += 1
            is_last = done >= total
            outputs.append(self._output(rid, done, "length" if is_last else None))
            if is_last:
                del self.progress[rid]
            else:
                self.progress[rid] = (done, total)
        return outputs


def _request(request_id: str, prompt: list[int], params: SamplingParams) -> ProcessedRequest:
    return ProcessedRequest(request_id, prompt, None, params, 0, time.monotonic())


async def _started(factory=FakeEngine) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(EngineConfig(), engine_factory=factory, idle_wait_s=0.05)
    engine.start()
    await engine.wait_ready()
    return engine


def test_generate_streams_until_finished() -> None:
    async def main() -> list[RequestOutput]:
        engine = await _started()
        outputs = [
            out
            async for out in engine.generate(_request("a", [1, 2], SamplingParams(max_tokens=5)))
        ]
        engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert (
        len(outputs) == 5
        and outputs[-1].finished
        and outputs[-1].outputs[0].finish_reason == "length"
    )
    assert not any(o.finished for o in outputs[:-1])


def test_cancelling_the_consumer_aborts_the_request() -> None:
    async def main() -> FakeEngine:
        engine = await _started()
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(
                _request("long", [1], SamplingParams(max_tokens=10_000))
            ):
                seen.set()

        task = asyncio.ensure_future(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if engine.engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.num_streams == 0
        fake = engine.engine
        engine.shutdown()
        return fake  # type: ignore[return-value]

    fake = asyncio.run(main())
    assert fake.aborted == ["long"] and not fake.progress


def test_add_error_reaches_only_that_request() -> None:
    async def main() -> None:
        engine = await _started()
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate(_request("bad", [666], SamplingParams(max_tokens=2))):
                pass
        good = [
            o async for o in engine.generate(_request("good", [1], SamplingParams(max_tokens=2)))
        ]
        assert good[-1].finished
        engine.shutdown()

    asyncio.run(main())


def test_step_crash_marks_dead_and_fails_in_flight() -> None:
    async def main() -> None:
        engine = await _started()
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(
                _request("victim", [1], SamplingParams(max_tokens=10_000))
            ):
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        engine.engine.should_fail = True  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 10)
        assert (
            engine.state is EngineState.DEAD and not engine.is_ready and not engine.failed_to_load
        )
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(_request("late", [1], SamplingParams(max_tokens=2))):
                pass
        engine.shutdown()

    asyncio.run(main())


def test_load_failure_is_reported() -> None:
    def broken(config: EngineConfig) -> FakeEngine:
        raise OSError("no weights")

    async def main() -> AsyncLLMEngine:
        engine = AsyncLLMEngine(EngineConfig(), engine_factory=broken)
        engine.start()
        with pytest.raises(EngineDeadError):
            await engine.wait_ready()
        return engine

    assert asyncio.run(main()).failed_to_load
