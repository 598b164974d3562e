"""The executor contract: run a step on every worker, or call a method on every worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tokenmill.core.messages import StepOutput, StepPlan
from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


class WorkerDiedError(TokenmillError, RuntimeError):
    """A worker process exited or stopped answering; the message names its rank."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} died: {detail}")
        self.rank = rank


class Executor(ABC):
    """Reaches ``world_size`` workers; the engine calls nothing else on them."""

    world_size: int = 1
    is_in_process: bool = True
    """True when plans can hand objects over as they are (nothing is encoded)."""

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), result_type: Any = Any
    ) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; the answers in rank order
        (converted to ``result_type`` when they crossed a process)."""

    @abstractmethod
    def execute_model(self, plan: StepPlan) -> StepOutput:
        """Run one step on every rank; rank 0's output."""

    @property
    def runner(self) -> ModelRunner:
        """The in-process worker's runner (tests and scoring reach the model through it)."""
        raise RuntimeError("the model runs in worker processes: no runner in the engine")

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker is gone (in-process: never)."""
        return None

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        return None
