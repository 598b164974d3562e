"""A tensor-parallel rank killed under the real server: /health turns 503, in-flight and new
requests get the API's error, the server exits 1, and the error names the rank."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.entrypoints.conftest import assert_error
from tests.entrypoints.inprocess import WAIT_S, serve_in_process, wait_healthy
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineState
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.executor import WorkerDiedError
from tokenmill.executor.multiproc import MultiprocExecutor


def test_killed_rank_makes_health_503_and_the_server_exit_1(make_model) -> None:
    config = EngineConfig(
        model=str(make_model("llama")),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        num_threads=1,
        tensor_parallel_size=2,
    )
    engine = AsyncLLMEngine(config)
    served = serve_in_process(engine, ServerConfig(max_num_seqs=4), config)
    served.server.dead_engine_grace_s = 5.0
    try:
        deadline = time.monotonic() + 4 * WAIT_S  # two ranks spawn and load first
        while not engine.is_ready:
            assert engine.state is not EngineState.DEAD, engine.error
            assert time.monotonic() < deadline, "the ranks never became ready"
            time.sleep(0.1)
        wait_healthy(served.base_url)
        body = {"prompt": [5, 6, 7], "max_tokens": 3}
        ok = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=WAIT_S)
        assert ok.status_code == 200, ok.text
        executor = engine.engine.executor
        assert isinstance(executor, MultiprocExecutor)
        os.kill(executor.pids[1], signal.SIGKILL)  # while idle: found without any request
        deadline = time.monotonic() + WAIT_S
        while engine.state is not EngineState.DEAD:
            assert time.monotonic() < deadline, "the dead rank was never noticed"
            time.sleep(0.05)
        assert isinstance(engine.error, WorkerDiedError) and engine.error.rank == 1
        assert "rank 1 died" in str(engine.error)
        assert_error(httpx.get(f"{served.base_url}/health", timeout=10), 503)
        served.thread.join(WAIT_S)
        assert not served.thread.is_alive(), "the server kept running with a dead rank"
        assert served.server.exit_code == 1
    finally:
        served.stop()
        engine.shutdown()  # its loop's end stops the ranks still alive
