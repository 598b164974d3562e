"""DraftProposer: a small model with the target's tokenizer proposes draft tokens.

The draft has its own KV tensors with the target's block layout, so it reads and writes
through the same block tables the scheduler hands the target: no second block manager.
Before the target's forward, each request the scheduler gave draft slots first catches
the draft up on the tokens it has not seen (its draft KV is valid up to the target's
verified count, or less), then the draft decodes greedily, one token per draft slot.
Greedy drafting makes the proposal a point mass, which is what verification assumes
(``sampling.speculative``), so the output stays exactly the target's. Rejected drafts'
draft KV is simply not counted as valid any more; freed blocks take it with them.
"""

from __future__ import annotations

import copy

import torch

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.model.base import CausalLM
from tokenmill.sampling.sampler import Sampler
from tokenmill.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class DraftProposer:
    """Fills the draft slots of scheduled requests (``Request.spec_token_ids``)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        """The draft model's runner (its own KV tensors, no LoRA, no grammar)."""
        self.num_forwards = 0
        """Draft forwards run (tests check that a step without proposals runs none)."""
        self.num_tokens = 0
        """Tokens those forwards computed."""

    @classmethod
    def build(
        cls,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> DraftProposer:
        return cls(ModelRunner(model, kv_caches, block_size, Sampler(device), device))

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput) -> None:
        """Run the draft on what the scheduler granted (``sched.draft_catch_up``): catch its
        KV up, then replace the placeholder drafts of each request by the draft's tokens."""
        views: list[tuple[Request, Request, int]] = []
        for request, _ in sched.scheduled:
            catch_up = sched.draft_catch_up.get(request.request_id, 0)
            if not catch_up:
                continue
            view = copy.copy(request)
            bias = request.sampling_params.logit_bias  # the target's, so drafts follow it
            view.sampling_params = _GREEDY.clone(logit_bias=bias) if bias else _GREEDY
            view.output_token_ids = list(request.output_token_ids)
            view.spec_token_ids = []
            view.grammar = None
            view.lora_id = 0
            view.eos_token_ids = frozenset()
            view.num_computed_tokens = request.num_tokens - request.num_draft_lag
            views.append((request, view, catch_up))
        if not views:
            return
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in views}
        steps = [(v, n) for _, v, n in views]  # the first forward: each request's catch-up
        while steps:
            self.num_forwards += 1
            self.num_tokens += sum(n for _, n in steps)
            out = self.runner.execute(
                SchedulerOutput(
                    scheduled=steps,
                    block_tables={v.request_id: sched.block_tables[v.request_id] for v, _ in steps},
                )
            )
            for view, num_new in steps:
                view.num_computed_tokens += num_new
            steps = []
            for request, view, _ in views:
                request.num_draft_computed_tokens = view.num_computed_tokens
                token = out.sampled.get(view.request_id)
                mine = drafts[request.request_id]
                if token is None or len(mine) >= len(request.spec_token_ids):
                    continue  # caught up part of the way, or done proposing
                view.output_token_ids.append(token)
                mine.append(token)
                if len(mine) < len(request.spec_token_ids):
                    steps.append((view, 1))
        for request, _, _ in views:
            request.spec_token_ids = drafts[request.request_id]
