"""The ``draft_model`` method: a small model with the target's tokenizer proposes drafts.

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
import logging

import torch

from tokenmill.core.messages import StepOutput
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.core.speculative import max_draft_tokens
from tokenmill.errors import ConfigError
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.layers import Linear, gemv_layout_wanted
from tokenmill.model.loader import load_model
from tokenmill.model.source import resolve_model_path
from tokenmill.sampling.sampler import Sampler
from tokenmill.worker.compiled_step import CompiledDecodeStep, default_buckets
from tokenmill.worker.draft_loop import CompiledDraftLoop
from tokenmill.worker.kv_cache import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.row_forward import RowForward
from tokenmill.worker.spec_decode.base import Proposer, ProposerContext, produced

logger = logging.getLogger(__name__)

_Row = tuple[Request, list[int], int, list[int], bool]
"""A request in the row loop: (request, block table, next position, tokens to feed, proposes)."""

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class DraftModelProposer(Proposer):
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
    def build(cls, ctx: ProposerContext) -> DraftModelProposer:
        """Load the draft, with KV tensors in the target's block layout (model dtype), its
        decode step compiled where the target's is (static), its chained forwards compiled
        unless ``--enforce-eager``."""
        model, caches = _load_draft(ctx)
        compiled = None
        loops: dict[tuple[int, int], CompiledDraftLoop] = {}
        compile_time_s = 0.0
        if ctx.may_compile and model.supports_compiled_decode:
            if ctx.wants_compiled_decode:
                compiled = _compile_draft(ctx, model, caches)
                compile_time_s += compiled.compile_time_s
            k = ctx.speculative.num_speculative_tokens
            for first_rows in (1, 2):  # a catch-up after a rejection; after a full acceptance
                loop = _compile_draft_loop(ctx, model, caches, first_rows, k)
                if loop is not None:
                    compile_time_s += loop.compile_time_s
                    loops[first_rows, k] = loop
        proposer = cls.from_parts(model, caches, ctx.block_size, ctx.device, compiled, loops)
        proposer.compile_time_s = compile_time_s
        return proposer

    @classmethod
    def from_parts(
        cls,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        compiled: CompiledDecodeStep | None = None,
        loops: dict[tuple[int, int], CompiledDraftLoop] | None = None,
    ) -> DraftModelProposer:
        """``compiled``: the draft's compiled decode step (the rows run eagerly without);
        ``loops``: its compiled chains of forwards, by (catch-up length, drafts)."""
        rows = None
        if RowForward.supports(model):
            scratch = kv_caches[0][0].shape[0] - 1  # allocate_kv_cache's extra block
            rows = RowForward(model, kv_caches, block_size, scratch, device, compiled)
        runner = ModelRunner(model, kv_caches, block_size, Sampler(device), device)
        return cls(runner, rows, loops if rows is not None else None)

    def num_proposable(
        self, batch: ScheduledBatch, output: StepOutput, limit: int
    ) -> dict[str, int]:
        """A draft can always propose: ``limit``, or what the request may still produce."""
        counts: dict[str, int] = {}
        for request, new_tokens in produced(batch, output):
            room = min(limit, max_draft_tokens(request) - len(new_tokens))
            if room > 0:
                counts[request.request_id] = room
        return counts

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
            view.num_spec_tokens = 0
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
                if token is None or len(mine) >= request.num_spec_tokens:
                    continue  # caught up part of the way, or done proposing
                view.output_token_ids.append(token)
                mine.append(token)
                if len(mine) < request.num_spec_tokens:
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
                if not proposes or len(mine) >= request.num_spec_tokens:
                    continue
                mine.append(token)
                if len(mine) < request.num_spec_tokens:
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
        loop = self.loops.get((len(feed), request.num_spec_tokens))
        if loop is None or len(live) > loop.max_batch:
            return None
        shape = (loop.first_rows, loop.num_steps)
        if all(proposes and (len(f), r.num_spec_tokens) == shape for r, _, _, f, proposes in live):
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


def _load_draft(
    ctx: ProposerContext,
) -> tuple[CausalLM, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The draft model and its KV tensors in the target's block layout (model dtype)."""
    spec = ctx.speculative
    assert spec.model is not None
    folder = resolve_model_path(spec.model)
    try:
        draft_config = ModelConfig.from_folder(folder)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--speculative-config: draft model {spec.model!r}: {exc}") from None
    if draft_config.vocab_size != ctx.model_config.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft's vocabulary ({draft_config.vocab_size}) is not "
            f"the target's ({ctx.model_config.vocab_size}): they must share a tokenizer"
        )
    # One-row GEMVs (a draft forward is one token per request): plain weights through
    # F.linear beat oneDNN's prepacked layout at these sizes (fp32, one thread, the
    # demo draft's four projections: 84 vs 152 us a forward), the vocabulary-wide head
    # excepted (66 vs 74 us packed); tokenmill's GEMV blocks beat both (fp32, one and two
    # rows: 5.5-21 us a projection against 6-68 for F.linear, 30 against 47 for the
    # head). The draft's rounding never reaches the output.
    model = load_model(
        folder, ctx.dtype, ctx.device, ctx.max_model_len, draft_config, prepack=False
    )
    if ctx.device.type == "cpu":
        gemv = gemv_layout_wanted()
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or (gemv and module.pack_for_gemv()):
                continue
            if name == "lm_head":
                module.pack_for_onednn()
    caches = allocate_kv_cache(draft_config, ctx.num_blocks, ctx.block_size, ctx.dtype, ctx.device)
    logger.info(
        "speculative decoding: draft %s (%.1fM params), its KV in the target's blocks (%.2f GiB)",
        folder,
        draft_config.num_params / 1e6,
        sum(k.nbytes + v.nbytes for k, v in caches) / 2**30,
    )
    return model, caches


def _compile_draft(
    ctx: ProposerContext, model: CausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> CompiledDecodeStep:
    """The draft's compiled decode step (static). Under ``static`` the target's decode
    step is compiled, so the draft's k eager forwards are what a speculative step
    costs most; compiled alone, one demo-draft forward took 450-560 us against 750-830
    eagerly (one thread, loaded machine). Under ``paged`` these rows (catch-ups) run
    eagerly: the same compile measured no faster per engine step there (within noise);
    the chained forwards after a catch-up are compiled under both
    (``CompiledDraftLoop``). Buckets: powers of two up to two rows (a catch-up) per
    request that may speculate (``disable_by_batch_size``); ``--enforce-eager`` keeps
    it eager."""
    rows = 2 * min(ctx.config.max_num_seqs, ctx.speculative.max_batch_size)
    num_blocks_and_scratch, block_size = caches[0][0].shape[:2]
    compiled = CompiledDecodeStep(
        model,
        caches,
        block_size,
        max_blocks_per_seq=-(-ctx.max_model_len // block_size),
        scratch_block=num_blocks_and_scratch - 1,
        buckets=default_buckets(rows, ctx.device),
        device=ctx.device,
    )
    logger.info(
        "speculative decoding: the draft's decode step compiled for %s rows in %.1fs",
        compiled.buckets,
        compiled.compile_time_s,
    )
    return compiled


def _compile_draft_loop(
    ctx: ProposerContext,
    model: CausalLM,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    first_rows: int,
    num_steps: int,
) -> CompiledDraftLoop | None:
    """A step's ``num_steps`` draft forwards (the first over a ``first_rows``-token
    catch-up) as one compiled call, for the batches the policy gives the full k (up to
    half of ``disable_by_batch_size`` requests)."""
    num_blocks_and_scratch, block_size = caches[0][0].shape[:2]
    if first_rows + num_steps - 1 > block_size:
        return None
    requests = min(ctx.config.max_num_seqs, max(1, ctx.speculative.max_batch_size // 2))
    loop = CompiledDraftLoop(
        model,
        caches,
        block_size,
        max_blocks_per_seq=-(-ctx.max_model_len // block_size),
        scratch_block=num_blocks_and_scratch - 1,
        num_steps=num_steps,
        buckets=default_buckets(requests, ctx.device),
        device=ctx.device,
        first_rows=first_rows,
    )
    logger.info(
        "speculative decoding: %d draft forwards after a %d-token catch-up compiled as "
        "one call for up to %d requests in %.1fs",
        num_steps,
        first_rows,
        loop.max_batch,
        loop.compile_time_s,
    )
    return loop if loop.max_batch else None
