"""Step runners: how a step's forward runs, chosen once when the KV cache is initialised.

A runner declares what it needs (``refusal``: why it cannot run this model here, None when
it can), is built once (``build``) and then runs the steps it takes (``forward``: the
step's hidden states, or None to pass the step on). ``choose_step_runners`` walks
``STEP_RUNNERS`` in order of preference: every runner that accepts is built, until one that
takes every step (``takes_every_step``) ends the chain, so the compiled decode step keeps an
eager runner behind it for prefill chunks and batches beyond its buckets. The choice and
each refusal are logged in one start-up line, so a slow start says which layer feature kept
the faster runner out. vLLM v1 picks its model runner once the same way; nothing after
start-up asks again which path a step takes.

- ``compiled``: decode-only steps through the fixed-shape ``CompiledDecodeStep``
  (torch.compile; the static KV strategy, or ``--compile-batch-sizes``).
- ``fused``: the model's forward, its decode-only steps running every decoder layer in one
  CPU-kernel call (``model/fused_decode.py``), bit-identical to ``eager``.
- ``eager``: the model's forward layer by layer; verification rows without a compiled step
  run as decode rows (``RowForward``).

A new runner is one ``StepRunner`` subclass passed to ``register_step_runner``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from tokenmill.config import EngineConfig
from tokenmill.model import fused_decode
from tokenmill.model.base import CausalLM
from tokenmill.worker.compiled_step import CompiledDecodeStep

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)


@dataclass
class RunnerContext:
    """What a runner may look at to decide and to build itself (one rank's start-up facts)."""

    config: EngineConfig
    model: CausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    num_blocks: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    """The activation dtype."""
    compile_buckets: list[int] = field(default_factory=list)
    """Batch sizes the compiled decode step is built for."""
    compile_refusal: str | None = None
    """Why the worker will not compile the decode step (KV strategy, flags, model, ranks)."""


class StepRunner(ABC):
    """One way to run a step's forward (see the module docstring)."""

    name: ClassVar[str]
    takes_every_step: ClassVar[bool] = True
    """False for a runner that passes some steps on (``forward`` returning None)."""

    @classmethod
    @abstractmethod
    def refusal(cls, ctx: RunnerContext) -> str | None:
        """Why this runner cannot run ``ctx.model`` here; None when it can."""

    @classmethod
    def build(cls, ctx: RunnerContext) -> StepRunner:
        """The runner for ``ctx`` (called once, after ``refusal`` said None)."""
        return cls()

    def describe(self) -> str:
        """How the start-up line names this runner."""
        return self.name

    @abstractmethod
    def forward(self, runner: ModelRunner, inputs: StepInputs) -> torch.Tensor | None:
        """The step's hidden states, or None when this runner does not take the step."""


STEP_RUNNERS: list[type[StepRunner]] = []
"""Runners in order of preference."""


def register_step_runner(
    cls: type[StepRunner], before: type[StepRunner] | None = None
) -> type[StepRunner]:
    """Add a runner, preferred over ``before`` (default: after every registered one)."""
    if cls in STEP_RUNNERS:
        raise ValueError(f"step runner {cls.name!r} is registered already")
    STEP_RUNNERS.insert(STEP_RUNNERS.index(before) if before else len(STEP_RUNNERS), cls)
    return cls


class CompiledRunner(StepRunner):
    """Decode-only steps (and verification rows) through the compiled fixed-shape step."""

    name = "compiled"
    takes_every_step = False

    def __init__(self, step: CompiledDecodeStep) -> None:
        self.step = step

    @classmethod
    def refusal(cls, ctx: RunnerContext) -> str | None:
        return ctx.compile_refusal

    @classmethod
    def build(cls, ctx: RunnerContext) -> StepRunner:
        ctx.model.attn_backend.init_capture(
            max(ctx.compile_buckets, default=0), -(-ctx.max_model_len // ctx.block_size)
        )
        return cls(
            CompiledDecodeStep(
                ctx.model,
                ctx.kv_caches,
                ctx.block_size,
                max_blocks_per_seq=-(-ctx.max_model_len // ctx.block_size),
                scratch_block=ctx.num_blocks,
                buckets=ctx.compile_buckets,
                device=ctx.device,
            )
        )

    def describe(self) -> str:
        return f"compiled (up to {self.step.max_batch} rows)"

    def forward(self, runner: ModelRunner, inputs: StepInputs) -> torch.Tensor | None:
        if inputs.decode_rows is None:
            return None
        runner.num_compiled_steps += 1
        runner.num_compiled_verify_steps += bool(inputs.spec_rows)
        return self.step.run(*inputs.decode_rows)


class EagerRunner(StepRunner):
    """The model's forward, layer by layer; takes every step."""

    name = "eager"
    runs_fused_decode: ClassVar[bool] = False
    """What the model is told: whether its decode-only steps run as one kernel call."""

    @classmethod
    def refusal(cls, ctx: RunnerContext) -> str | None:
        return None

    @classmethod
    def build(cls, ctx: RunnerContext) -> StepRunner:
        ctx.model.runs_fused_decode = cls.runs_fused_decode
        return cls()

    def forward(self, runner: ModelRunner, inputs: StepInputs) -> torch.Tensor:
        if inputs.decode_rows is not None:  # verification rows without a compiled step
            assert runner.rows is not None
            runner.num_row_verify_steps += 1
            return runner.rows.run(*inputs.decode_rows)
        return runner.model(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.lora
        )


class FusedRunner(EagerRunner):
    """The eager forward, whose decode-only steps run every layer in one CPU-kernel call."""

    name = "fused"
    runs_fused_decode = True

    @classmethod
    def refusal(cls, ctx: RunnerContext) -> str | None:
        if not ctx.config.fused_decode:
            return "--no-fused-decode"
        if not fused_decode.enabled():
            return f"{fused_decode.ENV_SWITCH}=0"
        return ctx.model.fused_decode_refusal(ctx.dtype)


for _runner in (CompiledRunner, FusedRunner, EagerRunner):
    register_step_runner(_runner)


@dataclass
class StepRunnerChoice:
    """The runners a rank uses, in the order a step is offered to them, and why the others
    were refused."""

    runners: list[StepRunner]
    refused: dict[str, str]

    def describe(self) -> str:
        """The start-up line's text: ``fused (refused compiled: --enforce-eager)``."""
        chosen = ", then ".join(r.describe() for r in self.runners)
        refused = "; ".join(f"{name}: {why}" for name, why in self.refused.items())
        return chosen + (f" (refused {refused})" if refused else "")


def choose_step_runners(ctx: RunnerContext) -> StepRunnerChoice:
    """The runners for ``ctx`` (see the module docstring); the last one takes every step."""
    runners: list[StepRunner] = []
    refused: dict[str, str] = {}
    for cls in STEP_RUNNERS:
        reason = cls.refusal(ctx)
        if reason is not None:
            refused[cls.name] = reason
            continue
        runners.append(cls.build(ctx))
        if cls.takes_every_step:
            break
    if not runners or not runners[-1].takes_every_step:
        raise RuntimeError(f"no registered step runner takes every step ({refused})")
    return StepRunnerChoice(runners, refused)
