"""DraftProposer: a small model with the target's tokenizer proposes draft tokens.

The draft has its own KV tensors with the target's block layout, so it reads and writes
through the same block tables the scheduler hands the target: no second block manager.
Before the target's forward, each request the scheduler gave draft slots first catches
the draft up on the tokens it has not seen (its draft KV is valid up to the target's
verified count, or less), then the draft decodes greedily, one token per draft slot.
Greedy drafting makes the proposal a point mass, which is what verification assumes
(``sampling.speculative``), so the output stays exactly the target's. Rejected drafts'
draft KV is simply not counted as valid any more; freed blocks take it with them.

The common step (a catch-up of one or two tokens, then k - 1 single tokens) runs as decode
rows in a tight loop (``RowForward``: compiled when the engine compiles the draft, else
eager with decode metadata) and an argmax, with no scheduler output, sampler or input
layout per forward: on a one-layer draft those cost as much as the forward itself. A long
catch-up (after a prefill or a preemption), a logit_bias or a model without decode
metadata takes the general path through the draft's ``ModelRunner``. What the draft
proposes may differ in rounding between the two paths; what is kept never does, since
verification decides.
"""

from __future__ import annotations

import copy

import torch

from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.model.base import CausalLM
from tokenmill.sampling.sampler import Sampler
from tokenmill.worker.compiled_step import CompiledDecodeStep
from tokenmill.worker.draft_loop import CompiledDraftLoop
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.row_forward import RowForward

_Row = tuple[Request, list[int], int, list[int], bool]
"""A request in the row loop: (request, block table, next position, tokens to feed, proposes)."""

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class DraftProposer:
    """Fills the draft slots of scheduled requests (``Request.spec_token_ids``)."""

    MAX_ROW_CATCH_UP = 4
    """The longest catch-up the row path takes (usually 1 or 2: the last verified tokens)."""

    def __init__(
        self,
        runner: ModelRunner,
        rows: RowForward | None = None,
        loops: dict[tuple[int, int], CompiledDraftLoop] | None = None,
    ) -> None:
        self.runner = runner
        """The draft model's runner (its own KV tensors, no LoRA, no grammar)."""
        self.rows = rows
        """The tight decode-row loop; None: every forward goes through the runner."""
        self.loops = loops or {}
        """By (catch-up length, drafts): a step's draft forwards as one compiled call (the
        common catch-ups of one and two tokens, k drafts); empty (``--enforce-eager``):
        one call per forward."""
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
        compiled: CompiledDecodeStep | None = None,
        loops: dict[tuple[int, int], CompiledDraftLoop] | None = None,
    ) -> DraftProposer:
        """``compiled``: the draft's compiled decode step (the rows run eagerly without);
        ``loops``: its compiled chains of forwards, by (catch-up length, drafts)."""
        rows = None
        if RowForward.supports(model):
            scratch = kv_caches[0][0].shape[0] - 1  # allocate_kv_cache's extra block
            rows = RowForward(model, kv_caches, block_size, scratch, device, compiled)
        runner = ModelRunner(model, kv_caches, block_size, Sampler(device), device)
        return cls(runner, rows, loops if rows is not None else None)

    @torch.inference_mode()
    def propose(self, sched: ScheduledBatch) -> None:
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
        if self.rows is not None and all(
            n <= self.MAX_ROW_CATCH_UP and not v.sampling_params.logit_bias for _, v, n in views
        ):
            self._propose_rows(sched, views, self.rows)
            return
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in views}
        steps = [(v, n) for _, v, n in views]  # the first forward: each request's catch-up
        while steps:
            self.num_forwards += 1
            self.num_tokens += sum(n for _, n in steps)
            out = self.runner.execute(
                ScheduledBatch(
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

    def _propose_rows(
        self,
        sched: ScheduledBatch,
        views: list[tuple[Request, Request, int]],
        rows: RowForward,
    ) -> None:
        """The general loop's result, by decode rows: each forward lays out its rows
        directly (token, position, slot, block table) and takes the argmax of the rows
        that end a request's input."""
        bs = rows.block_size
        model = self.runner.model
        live: list[_Row] = []
        for request, view, catch_up in views:
            start = view.num_computed_tokens
            feed = view.token_slice(start, start + catch_up)
            # A catch-up short of the last token proposes nothing (as the general path).
            proposes = start + catch_up == view.num_tokens
            live.append((request, sched.block_tables[request.request_id], start, feed, proposes))
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in views}
        loop = self._loop_for(live)
        if loop is not None:  # the usual step: all of its drafting in one call
            self._run_loop(loop, live, drafts)
            live = []
        while live:
            ids: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            tables: list[list[int]] = []
            ends: list[int] = []
            for _, table, start, feed, _ in live:
                for j, token in enumerate(feed):
                    pos = start + j
                    ids.append(token)
                    positions.append(pos)
                    slots.append(table[pos // bs] * bs + pos % bs)
                    tables.append(table)
                ends.append(len(ids) - 1)
            self.num_forwards += 1
            self.num_tokens += len(ids)
            hidden = rows.run(ids, positions, slots, tables)
            picked = (
                hidden
                if len(ends) == len(ids)
                else hidden[torch.tensor(ends, device=hidden.device)]
            )
            tokens = model.compute_logits(picked).argmax(dim=-1).tolist()
            following: list[_Row] = []
            for (request, table, start, feed, proposes), token in zip(live, tokens, strict=True):
                request.num_draft_computed_tokens = start + len(feed)
                mine = drafts[request.request_id]
                if not proposes or len(mine) >= len(request.spec_token_ids):
                    continue
                mine.append(token)
                if len(mine) < len(request.spec_token_ids):
                    following.append((request, table, start + len(feed), [token], True))
            live = following
        for request, _, _ in views:
            request.spec_token_ids = drafts[request.request_id]

    def _loop_for(self, live: list[_Row]) -> CompiledDraftLoop | None:
        """The compiled loop that takes the whole step: every request catches up on the
        same number of tokens and wants the same number of drafts, and the batch fits."""
        if not self.loops:
            return None
        request, _, _, feed, _ = live[0]
        loop = self.loops.get((len(feed), len(request.spec_token_ids)))
        if loop is None or len(live) > loop.max_batch:
            return None
        shape = (loop.first_rows, loop.num_steps)
        if all(
            proposes and (len(f), len(r.spec_token_ids)) == shape for r, _, _, f, proposes in live
        ):
            return loop
        return None

    def _run_loop(
        self, loop: CompiledDraftLoop, live: list[_Row], drafts: dict[str, list[int]]
    ) -> None:
        """Every live request's drafts in one compiled call."""
        self.num_forwards += loop.num_steps
        self.num_tokens += len(live) * (loop.first_rows + loop.num_steps - 1)
        tokens = loop.run(
            [token for *_, feed, _ in live for token in feed],
            [start + j for _, _, start, feed, _ in live for j in range(len(feed))],
            [table for _, table, *_ in live],
        )
        for (request, _, start, feed, _), mine in zip(live, tokens, strict=True):
            request.num_draft_computed_tokens = start + len(feed) + loop.num_steps - 1
            drafts[request.request_id].extend(mine)
