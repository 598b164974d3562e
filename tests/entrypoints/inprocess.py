"""``tokenmill serve``'s server in-process, with an engine whose steps the test hands out.

Tests that are about *when* something happens relative to engine steps (a client leaving,
a drain, a timeout) gate the engine instead of racing it: ``StepGate`` lets the engine
thread take a step only when the test allows one, and records which requests each step
scheduled and how far their prompts were computed. So what the tests check is the same on
a fast machine, a slow one and a busy one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import uvicorn

from tests.entrypoints.conftest import free_port
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.openai.server import GracefulServer, build_app
from tokenmill.entrypoints.openai.state import ServerConfig

WAIT_S = 60.0
"""How long a test waits for an event before it fails: only reached when something is broken."""


@dataclass
class Scheduled:
    """One step's view of a request it scheduled."""

    step: int
    is_prefill_done: bool
    """Whether the prompt was fully computed after this step."""


@dataclass
class StepGate:
    """Hands out engine steps: ``allow(n)`` lets n more run, ``open()`` lets all run."""

    num_steps: int = 0
    """Steps completed."""
    scheduled: dict[str, list[Scheduled]] = field(default_factory=lambda: defaultdict(list))
    """Per engine request id: every step that scheduled it."""
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _num_allowed: int = 0
    _is_open: bool = False

    def allow(self, num_steps: int = 1) -> None:
        with self._cond:
            self._num_allowed += num_steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._is_open = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._is_open = False

    def step_and_wait(self) -> None:
        """Let exactly one more step run and wait until it has."""
        target = self.num_steps + 1
        self.allow()
        self.wait_until(lambda: self.num_steps >= target, "the engine never took the allowed step")

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not predicate():
                assert time.monotonic() < deadline, what
                self._cond.wait(0.05)

    # ---- engine-thread side ----------------------------------------------------------------
    def wait_turn(self) -> None:
        """AsyncLLMEngine's ``step_gate``: block until a step is allowed."""
        with self._cond:
            while not (self._is_open or self._num_allowed > 0):
                self._cond.wait()
            if not self._is_open:
                self._num_allowed -= 1

    def _step_done(self, scheduled: list[tuple[str, bool]]) -> None:
        with self._cond:
            self.num_steps += 1
            for request_id, is_prefill_done in scheduled:
                self.scheduled[request_id].append(Scheduled(self.num_steps, is_prefill_done))
            self._cond.notify_all()

    def async_engine(self, config: EngineConfig) -> AsyncLLMEngine:
        """An AsyncLLMEngine whose steps wait for this gate and are recorded here."""
        return AsyncLLMEngine(config, engine_factory=self._engine_factory, step_gate=self.wait_turn)

    def _engine_factory(self, config: EngineConfig) -> LLMEngine:
        gate = self

        class GatedEngine(LLMEngine):
            def step(self):  # type: ignore[no-untyped-def]
                requests = []
                schedule = self.scheduler.schedule

                def recording_schedule():  # type: ignore[no-untyped-def]
                    sched = schedule()
                    requests.extend(r for r, _ in sched.scheduled)
                    return sched

                self.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
                try:
                    return super().step()
                finally:
                    self.scheduler.schedule = schedule  # type: ignore[method-assign]
                    gate._step_done(
                        [
                            (r.request_id, r.num_computed_tokens >= r.num_prompt_tokens)
                            for r in requests
                        ]
                    )

        return GatedEngine(config)


@dataclass
class InProcessServer:
    """A GracefulServer on a thread, talking HTTP on loopback."""

    engine: AsyncLLMEngine
    server: GracefulServer
    thread: threading.Thread
    base_url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


def serve_in_process(
    engine: AsyncLLMEngine, config: ServerConfig, engine_config: EngineConfig
) -> InProcessServer:
    """``tokenmill serve``'s server on a thread; returns once it answers HTTP (loaded or not)."""
    port = free_port()
    config = dataclasses.replace(config, port=port)
    app = build_app(engine, config, engine_config)
    uv_config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = GracefulServer(uv_config, app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server never started"
        time.sleep(0.02)
    return InProcessServer(engine, server, thread, f"http://127.0.0.1:{port}")


def wait_healthy(base_url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "in-process server never became healthy"
        time.sleep(0.05)
