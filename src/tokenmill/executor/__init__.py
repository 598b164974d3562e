"""Executors: how the engine reaches its workers (vLLM v1's executor layer).

``build_executor`` picks one from the config: ``UniProcExecutor`` (one worker in this
process, the default) or ``MultiprocExecutor`` (one process per tensor-parallel rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.executor.base import Executor, WorkerDiedError
from tokenmill.model.config import ModelConfig
from tokenmill.resolved_model import ResolvedModel

if TYPE_CHECKING:  # the in-process runner's type (``Executor.runner``), named for the engine
    from tokenmill.worker.model_runner import ModelRunner as ModelRunner


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """ConfigError at start-up for what tensor parallelism does not run (yet), instead of
    answers that would be silently wrong."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    spec = config.speculative
    refused = [
        (model_config.model_impl == "transformers", "the Transformers fallback (--model-impl)"),
        (config.enable_lora, "LoRA adapters (--enable-lora)"),
        (config.quantization is not None, "--quantization"),
        (spec is not None and spec.method == "draft_model", "a draft model (--speculative-config)"),
    ]
    names = [name for is_on, name in refused if is_on]
    if names:
        raise ConfigError(
            f"--tensor-parallel-size {tp} does not support {', '.join(names)} yet; "
            "use --tensor-parallel-size 1"
        )
    from tokenmill.model.tensor_parallel import check_supported

    check_supported(model_config, tp)


def build_executor(config: EngineConfig, resolved: ResolvedModel) -> Executor:
    """The executor ``--distributed-executor-backend`` names (default: uni at TP 1, else mp);
    its workers take the model as ``resolved`` (nothing about it is read again)."""
    backend = config.distributed_executor_backend or (
        "uni" if config.tensor_parallel_size == 1 else "mp"
    )
    if backend == "uni":
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, resolved)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, resolved)


__all__ = ["Executor", "WorkerDiedError", "build_executor", "check_tensor_parallel"]
