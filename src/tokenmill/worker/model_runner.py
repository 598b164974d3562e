"""ModelRunner: turns a ScheduledBatch into tensors, runs the model, samples.

``prepare_inputs`` is the one place where a step's inputs are laid out (token ids,
positions, KV slot mapping, block tables, logits rows); the model's attention backend turns
the layout into its own metadata once per step. Decode-shaped requests (one new token) form
one attention group and multi-token chunks another, so each is a single batched attention
call. Logits are computed only for rows that need them: the last token
of a request that reached its end (to sample) and prompt rows whose logprobs were asked.

Speculative verification (a request's last token plus its k draft tokens) is k + 1 rows
of one request. Under the ``static`` strategy's compiled step, such rows are decode rows:
each attends to the positions up to its own, and the decode op writes every row's K/V
before any row attends, so row i sees the drafts before it. A step of decodes and
verifications only therefore runs through the same fixed-shape graphs (buckets count
rows), with each row carrying its request's block table. Without the compiled step (the
``paged`` strategy) such a step runs the same decode rows eagerly (``RowForward``): the
verification's rows take the decode kernel, as its positions would one at a time, instead
of a prefill chunk's metadata, mask and gathered attention.

Sampling, grammar bookkeeping and prompt logprobs are per request: when the batched call
raises, each row is retried alone and only the rows that still raise are reported in
``StepOutput.failed`` (as text, so it can cross a process), so one request's failure never takes the batch (or the engine) down.
"""

from __future__ import annotations

import logging
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tokenmill.core.messages import StepOutput, VerifiedTokens
from tokenmill.core.request import Request
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.model.attention_backend import BatchGroup, StepBatch, StepMetadata
from tokenmill.model.base import CausalLM
from tokenmill.model.lora import LoRAStepState
from tokenmill.outputs import PositionLogprobs
from tokenmill.sampling.sampler import Sampler, top_logprobs
from tokenmill.sampling.speculative import verify
from tokenmill.structured.bitmask import GrammarMasks
from tokenmill.worker.kv_cache import copy_kv_blocks
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.row_forward import RowForward
from tokenmill.worker.step_runner import CompiledRunner, EagerRunner, StepRunner

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Tensors and bookkeeping for one forward pass."""

    input_ids: torch.Tensor | None
    """Flat token batch; None when the compiled decode step takes ``decode_rows`` instead."""
    positions: torch.Tensor | None
    meta: StepMetadata | None
    """The attention backend's metadata for the step (None for the compiled decode step)."""
    sample_rows: list[int]
    sample_requests: list[Request]
    prompt_logprob_rows: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    """request_id -> (rows, first position) for prompt logprobs in this chunk."""
    decode_rows: tuple[list[int], list[int], list[int], list[list[int]]] | None = None
    """(token ids, positions, slots, block tables) when every row is a lone decode token."""
    lora: LoRAStepState | None = None
    """Which rows run which adapter; None when every row is on the base model."""
    pool_rows: dict[str, tuple[Request, list[int], bool]] = field(default_factory=dict)
    """Pooling requests: request_id -> (request, rows its pooling reads, whether the prompt ends here)."""
    spec_rows: dict[str, tuple[Request, list[int], list[int]]] = field(default_factory=dict)
    """Requests verifying speculative tokens: request_id -> (request, its last token's row
    and the draft tokens' rows, the draft tokens)."""


def failure_text(exc: BaseException) -> str:
    """What a request's failure crosses to the engine as: its traceback, as text."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def _pooled_rows(pooling_type: str, rows: list[int], start: int, is_last: bool) -> list[int]:
    """The rows of a prefill chunk that a pooling reads: all (MEAN), the first token's
    (CLS, in the chunk at position 0) or the prompt's last token's (LAST, in the final chunk)."""
    if pooling_type == "MEAN":
        return rows
    if pooling_type == "CLS":
        return rows[:1] if start == 0 else []
    return rows[-1:] if is_last else []


class ModelRunner:
    """Owns the model, the KV tensors and the sampler on one device."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        step_runners: list[StepRunner] | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.step_runners = step_runners or [EagerRunner()]
        """The runners chosen at start-up (``worker/step_runner.py``), in the order a step
        is offered to them; default: the model's forward as it stands."""
        self.compiled_decode = next(
            (r.step for r in self.step_runners if isinstance(r, CompiledRunner)), None
        )
        """The compiled decode step, when a compiled runner was chosen (``prepare_inputs``
        lays decode-only steps out for it)."""
        self.lora = lora
        """Adapter slots, when LoRA is enabled."""
        self.num_compiled_steps = 0
        """Steps that ran the compiled decode forward (the rest ran eagerly)."""
        self.num_compiled_verify_steps = 0
        """Of those, steps that verified speculative tokens (k + 1 rows per request)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.grammar_masks = GrammarMasks(model.config.vocab_size)
        self._pool_sums: dict[str, torch.Tensor] = {}
        """MEAN/CLS pooling: what earlier prefill chunks of a request contributed."""
        self._logged_spec_eager = False
        self.rows: RowForward | None = None
        """Eager decode rows for verification steps without a compiled step (paged)."""
        if self.compiled_decode is None and RowForward.supports(model):
            scratch = kv_caches[0][0].shape[0] - 1 if kv_caches else 0
            self.rows = RowForward(model, kv_caches, block_size, scratch, device)
        self.num_row_verify_steps = 0
        """Verification steps that ran as eager decode rows (paged)."""

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def prepare_inputs(self, sched: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        decodes = [(r, n) for r, n in sched.scheduled if n == 1]
        chunks = [(r, n) for r, n in sched.scheduled if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        groups: list[BatchGroup] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_rows: dict[str, tuple[list[int], int]] = {}
        pool_rows: dict[str, tuple[Request, list[int], bool]] = {}
        lora_rows: dict[int, list[int]] = {}
        spec_rows: dict[str, tuple[Request, list[int], list[int]]] = {}
        row_tables: list[list[int]] = []
        """Per row: its request's block table (the compiled step takes one per row)."""
        for members, is_decode in ((decodes, True), (chunks, False)):
            if not members:
                continue
            token_index: list[list[int]] = []
            query_pos: list[list[int]] = []
            tables: list[list[int]] = []
            ctx_lens: list[int] = []
            for request, num_new in members:
                start = request.num_computed_tokens
                table = sched.block_tables[request.request_id]
                first_row = len(input_ids)
                rows = list(range(first_row, first_row + num_new))
                if request.lora_id:
                    lora_rows.setdefault(request.lora_id, []).extend(rows)
                pos = list(range(start, start + num_new))
                num_known = min(num_new, request.num_tokens - start)
                drafts = request.spec_token_ids[: num_new - num_known]
                input_ids.extend(request.token_slice(start, start + num_known) + drafts)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
                token_index.append(rows)
                query_pos.append(pos)
                tables.append(table[: -(-(start + num_new) // bs)])
                row_tables.extend([tables[-1]] * num_new)
                ctx_lens.append(start + num_new)
                if request.pooling is not None:
                    is_last = start + num_new == request.num_tokens
                    pool_rows[request.request_id] = (
                        request,
                        _pooled_rows(request.pooling.pooling_type, rows, start, is_last),
                        is_last,
                    )
                elif drafts and start + num_new == request.num_tokens + len(drafts):
                    spec_rows[request.request_id] = (request, rows[-len(drafts) - 1 :], drafts)
                elif start + num_new == request.num_tokens:
                    sample_rows.append(rows[-1])
                    sample_requests.append(request)
                if (
                    request.sampling_params.prompt_logprobs is not None
                    and start < request.num_prompt_tokens - 1
                ):
                    last = min(start + num_new, request.num_prompt_tokens - 1)
                    prompt_rows[request.request_id] = (rows[: last - start], start)
            groups.append(BatchGroup(is_decode, token_index, query_pos, tables, ctx_lens))
        lora = self.lora.build_step(lora_rows, len(input_ids)) if self.lora else None
        num_spec_rows = sum(len(rows) for _, rows, _ in spec_rows.values())
        # Decode rows and verification rows only (every chunk verifies drafts).
        is_decode_only = (
            len(spec_rows) == len(chunks)
            and not prompt_rows
            and not pool_rows
            and len(sample_rows) + num_spec_rows == len(input_ids)
        )
        compiled_fits = (
            self.compiled_decode is not None and len(input_ids) <= self.compiled_decode.max_batch
        )
        if (
            is_decode_only
            and lora is None  # the compiled forwards have no LoRA: such steps run eagerly
            and (compiled_fits or (bool(spec_rows) and self.rows is not None))
        ):
            return StepInputs(
                input_ids=None,
                positions=None,
                meta=None,
                sample_rows=sample_rows,
                sample_requests=sample_requests,
                decode_rows=(input_ids, positions, slots, row_tables),
                spec_rows=spec_rows,
            )
        if spec_rows and self.compiled_decode is not None and not self._logged_spec_eager:
            self._logged_spec_eager = True
            logger.info(
                "static: a step verifying speculative tokens ran eagerly (%d rows, a prefill "
                "chunk, prompt logprobs or a LoRA adapter in the step; compiled up to %d rows)",
                len(input_ids),
                self.compiled_decode.max_batch,
            )
        meta = self.model.attn_backend.build_metadata(StepBatch(slots, groups, len(input_ids)))
        return StepInputs(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            meta=meta,
            sample_rows=sample_rows,
            sample_requests=sample_requests,
            prompt_logprob_rows=prompt_rows,
            lora=lora,
            pool_rows=pool_rows,
            spec_rows=spec_rows,
        )

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the step, from the first runner that takes it."""
        for runner in self.step_runners:
            hidden = runner.forward(self, inputs)
            if hidden is not None:
                return hidden
        raise RuntimeError("no step runner took the step")  # the last one takes every step

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch) -> StepOutput:
        """Run one step: forward the scheduled tokens and sample where a request ends."""
        self.sampler.drop(sched.finished_ids)
        if sched.blocks_to_copy:  # before the forward writes into the private copies
            copy_kv_blocks(self.kv_caches, sched.blocks_to_copy)
        # A preempted sequence's matcher is rebuilt by replaying its tokens when it resumes.
        self.grammar_masks.drop(sched.finished_ids + sched.preempted_ids)
        for request_id in sched.finished_ids + sched.preempted_ids:
            self._pool_sums.pop(request_id, None)  # a preempted prompt is pooled again from 0
        out = StepOutput()
        if sched.is_empty:
            return out
        inputs = self.prepare_inputs(sched)
        # Grammar masks depend only on tokens already sampled: fill them while the model runs.
        masks = self.grammar_masks.bitmask_async(inputs.sample_requests)
        hidden = self.forward(inputs)
        if inputs.sample_rows:
            rows = inputs.sample_rows  # increasing: every row when the last is the last
            sampled = hidden if rows[-1] == len(hidden) - 1 == len(rows) - 1 else None
            if sampled is None:
                sampled = hidden[self._tensor(rows)]
            logits = self.model.compute_logits(sampled)
            self._sample(logits, inputs.sample_requests, masks, out)
        if inputs.spec_rows:
            self._verify(hidden, inputs.spec_rows, out)
        for request_id, (request, rows, is_complete) in inputs.pool_rows.items():
            pooled = self._pool(hidden, request, rows, is_complete)
            if pooled is not None:
                out.pooled[request_id] = pooled
        for request, _ in sched.scheduled:
            entry = inputs.prompt_logprob_rows.get(request.request_id)
            if entry is not None and request.request_id not in out.failed:
                try:
                    out.prompt_logprobs[request.request_id] = (
                        entry[1] + 1,
                        self._prompt_logprobs(hidden, request, *entry),
                    )
                except Exception as exc:  # that request fails alone
                    out.failed[request.request_id] = failure_text(exc)
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        masks: Future[torch.Tensor | None] | None,
        out: StepOutput,
    ) -> None:
        """Sample the batch in one call; if it raises, row by row, failing only bad rows."""
        try:
            bitmask = masks.result() if masks is not None else None
            result = self.sampler(logits, requests, bitmask)
            rows = list(zip(requests, result.token_ids, result.logprobs, strict=True))
        except Exception:
            rows = []
            for i, request in enumerate(requests):
                try:
                    alone = self.sampler(
                        logits[i : i + 1], [request], self.grammar_masks.bitmask([request])
                    )
                    rows.append((request, alone.token_ids[0], alone.logprobs[0]))
                except Exception as exc:
                    out.failed[request.request_id] = failure_text(exc)
        for request, token, lp in rows:
            try:
                out.grammar_ended |= self.grammar_masks.accept([request], [token])
            except Exception as exc:
                out.failed[request.request_id] = failure_text(exc)
                continue
            out.sampled[request.request_id] = token
            out.logprobs[request.request_id] = lp

    def _verify(
        self,
        hidden: torch.Tensor,
        spec_rows: dict[str, tuple[Request, list[int], list[int]]],
        out: StepOutput,
    ) -> None:
        """Keep each request's accepted draft tokens plus one more (a failure is its own)."""
        all_rows = [row for _, rows, _ in spec_rows.values() for row in rows]
        logits = self.model.compute_logits(hidden[self._tensor(all_rows)])
        first = 0
        for rid, (request, rows, drafts) in spec_rows.items():
            request_logits = logits[first : first + len(rows)]
            first += len(rows)
            try:
                bitmask = None
                if request.grammar is not None:
                    bitmask = self.grammar_masks.draft_bitmask(request, drafts)
                verified = verify(self.sampler, request_logits, request, drafts, bitmask)
                if request.grammar is not None:
                    self._accept_verified(request, verified, out)
            except Exception as exc:
                out.failed[rid] = failure_text(exc)
                continue
            out.sampled[rid] = verified.token_ids[0]
            out.logprobs[rid] = verified.logprobs[0]
            out.verified[rid] = verified

    def _accept_verified(self, request: Request, verified: VerifiedTokens, out: StepOutput) -> None:
        """Advance the grammar by the kept tokens; where it completes, the run ends there,
        as it would have ended decoding one token at a time."""
        for i, token in enumerate(verified.token_ids):
            if self.grammar_masks.accept([request], [token]):
                out.grammar_ended.add(request.request_id)
                del verified.token_ids[i + 1 :]
                del verified.logprobs[i + 1 :]
                return

    def _pool(
        self, hidden: torch.Tensor, request: Request, rows: list[int], is_complete: bool
    ) -> list[float] | None:
        """Fold this chunk's rows into the request's pooling; its vector once the prompt ends."""
        pooling = request.pooling
        assert pooling is not None
        rid = request.request_id
        if rows:
            part = hidden[self._tensor(rows)].float().sum(dim=0)
            previous = self._pool_sums.get(rid)
            self._pool_sums[rid] = part if previous is None else previous + part
        if not is_complete:
            return None
        vector = self._pool_sums.pop(rid)
        if pooling.pooling_type == "MEAN":
            vector = vector / request.num_prompt_tokens
        if pooling.dimensions is not None:
            vector = vector[: pooling.dimensions]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector.cpu().tolist()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, request: Request, rows: list[int], first_pos: int
    ) -> list[PositionLogprobs | None]:
        """Logprobs of prompt tokens first_pos+1 .. given the logits at rows."""
        logprobs = self.model.compute_logits(hidden[self._tensor(rows)]).log_softmax(dim=-1)
        targets = self._tensor(request.prompt_token_ids[first_pos + 1 : first_pos + 1 + len(rows)])
        entries: list[PositionLogprobs | None] = list(
            top_logprobs(logprobs, targets, request.sampling_params.prompt_logprobs or 0)
        )
        return entries
