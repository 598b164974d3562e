"""The proposer contract: how a speculative method guesses tokens on the workers.

A proposer lives on every worker (rank) beside the model runner. Each step it is asked two
things, in this order:

- ``propose(batch)``, before the target's forward: fill each scheduled request's granted
  draft slots (``Request.num_spec_tokens`` of them) into ``Request.spec_token_ids``; the
  runner schedules them after the last token and verification keeps what the target agrees
  with (``sampling/speculative.py``), so the output is the target's whatever is proposed.
- ``num_proposable(batch, output, limit)``, after sampling: for each request that produced
  tokens this step, how many (at most ``limit``) it can propose at the next step. The count
  is all the engine and the scheduler ever see (``StepOutput.num_proposable`` ->
  ``Request.num_spec_tokens`` -> ``StepPlan.num_spec_tokens``): no draft token id, and no
  placeholder, leaves the workers.

Adding a method (an EAGLE or MTP head, say) is one ``Proposer`` subclass and one
``register_proposer`` call; engine, scheduler and worker are unchanged. A proposer whose own
forwards should count in a step's token budget registers with ``charges_budget=True`` and
reads ``ScheduledBatch.draft_catch_up`` (what the scheduler granted it).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.messages import StepOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.core.speculative import SpeculativeConfig, register_method
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerContext:
    """What a worker knows when it builds its proposer (after its KV cache is allocated)."""

    config: EngineConfig
    speculative: SpeculativeConfig
    model: CausalLM
    """The target model (a proposer on its hidden states would read them from here)."""
    model_config: ModelConfig
    num_blocks: int
    block_size: int
    wants_compiled_decode: bool
    """The target's decode step is compiled (static): a draft may compile its own too."""
    may_compile: bool
    """Compiling is allowed here (not --enforce-eager, one process, a dtype mix that
    compiles right)."""
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


class Proposer(ABC):
    """Guesses the next tokens of running requests (see the module docstring)."""

    compile_time_s: float = 0.0
    """What building it spent compiling (added to the start-up costs)."""

    @classmethod
    @abstractmethod
    def build(cls, ctx: ProposerContext) -> Proposer:
        """The proposer for this worker (load a draft, compile, allocate its state)."""

    @abstractmethod
    def propose(self, batch: ScheduledBatch) -> None:
        """Before the forward: set ``spec_token_ids`` of each scheduled request that has
        ``num_spec_tokens`` (exactly that many tokens)."""

    @abstractmethod
    def num_proposable(
        self, batch: ScheduledBatch, output: StepOutput, limit: int
    ) -> dict[str, int]:
        """After sampling: per request that produced tokens (``output.sampled``), how many
        tokens it can propose next step, at most ``limit`` (0 entries may be left out)."""

    def drop(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional
        """Forget finished requests' state."""


def produced(batch: ScheduledBatch, output: StepOutput) -> list[tuple[Request, list[int]]]:
    """The requests of ``batch`` that produced tokens this step, with those tokens (one
    sampled, or the run verification kept), beams and pooling requests left out (the
    engine never asks drafts for them)."""
    done = []
    for request, _ in batch.scheduled:
        rid = request.request_id
        if rid not in output.sampled or request.is_beam or request.pooling is not None:
            continue
        verified = output.verified.get(rid)
        done.append((request, verified.token_ids if verified else [output.sampled[rid]]))
    return done


PROPOSERS: dict[str, type[Proposer]] = {}
"""``--speculative-config`` method -> its proposer."""


def register_proposer(method: str, cls: type[Proposer], *, charges_budget: bool = False) -> None:
    """Make ``method`` a valid ``--speculative-config`` method served by ``cls``;
    ``charges_budget``: its forwards count in the step's token budget (a draft model)."""
    PROPOSERS[method] = cls
    register_method(method, charges_budget=charges_budget)


def build_proposer(ctx: ProposerContext) -> Proposer:
    """The registered proposer of ``ctx.speculative.method``, built."""
    cls = PROPOSERS[ctx.speculative.method]
    return cls.build(ctx)
