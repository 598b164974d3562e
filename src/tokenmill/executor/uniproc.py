"""UniProcExecutor: the one worker lives in the engine's process; calls are plain calls.

Plans are not encoded here (parameters and grammars stay objects), so the default path
costs one diff per step over calling the runner directly.
"""

from __future__ import annotations

from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.messages import StepOutput, StepPlan
from tokenmill.executor.base import Executor
from tokenmill.resolved_model import ResolvedModel
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    """One in-process worker (rank 0 of 1)."""

    is_in_process = True

    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.driver_worker = Worker(config, resolved)
        self.world_size = 1

    @property
    def runner(self) -> ModelRunner:
        return self.driver_worker.runner

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), result_type: Any = Any
    ) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, plan: StepPlan) -> StepOutput:
        out = self.driver_worker.execute_model(plan)
        assert out is not None
        return out
