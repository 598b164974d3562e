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
        self._num_seen: dict[str, int] = {}
        """Per request: tokens whose draft KV was written (some may since be rejected)."""

    @classmethod
    def build(
        cls,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> DraftProposer:
        return cls(ModelRunner(model, kv_caches, block_size, Sampler(device), device))

    def drop(self, request_ids: list[str]) -> None:
        """Finished or preempted: a preempted request's blocks, draft KV included, are gone."""
        for rid in request_ids:
            self._num_seen.pop(rid, None)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput) -> None:
        """Replace the placeholder drafts of every scheduled request by the draft's tokens."""
        self.drop(sched.finished_ids + sched.preempted_ids)
        views: list[tuple[Request, Request]] = []
        for request, num_new in sched.scheduled:
            k = len(request.spec_token_ids)
            if not k or request.num_computed_tokens + num_new != request.num_tokens + k:
                continue
            view = copy.copy(request)
            view.sampling_params = _GREEDY
            view.output_token_ids = list(request.output_token_ids)
            view.spec_token_ids = []
            view.grammar = None
            view.lora_id = 0
            view.eos_token_ids = frozenset()
            seen = self._num_seen.get(request.request_id, 0)
            view.num_computed_tokens = min(seen, request.num_computed_tokens)
            views.append((request, view))
        if not views:
            return
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in views}
        num_drafts = max(len(r.spec_token_ids) for r, _ in views)
        for _ in range(num_drafts):
            active = [(r, v) for r, v in views if len(drafts[r.request_id]) < len(r.spec_token_ids)]
            if not active:
                break
            step_sched = SchedulerOutput(
                scheduled=[(v, v.num_tokens - v.num_computed_tokens) for _, v in active],
                block_tables={v.request_id: sched.block_tables[v.request_id] for _, v in active},
            )
            out = self.runner.execute(step_sched)
            for request, view in active:
                token = out.sampled[view.request_id]
                view.num_computed_tokens = view.num_tokens
                view.output_token_ids.append(token)
                drafts[request.request_id].append(token)
                self._num_seen[request.request_id] = view.num_computed_tokens
        for request, _ in views:
            request.spec_token_ids = drafts[request.request_id]
