"""GrammarMasks: one llguidance matcher per constrained sequence, and each step's
allowed-token bitmask for the whole batch.

The matcher follows the sequence's output tokens: before a step it replays any it has not
seen (a matcher dropped at preemption, or created after the first tokens), so recompute
after preemption needs no special case. Masks of all constrained rows are filled in one
call on llguidance's thread pool (it releases the GIL); unconstrained rows stay all ones
and a batch without a grammar builds no mask at all. The runner fills the masks on a helper
thread while the model runs (they depend only on tokens already sampled).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from tokenmill.core.request import Request
from tokenmill.structured.grammar import CompiledGrammar

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens whose bit is 0 to -inf, in place, for every row at once."""
    batch, vocab = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)  # 32x smaller than the bool mask
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(batch, -1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


class GrammarMasks:
    """The worker's matcher table (kept across steps, dropped when a sequence ends)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._sequences: dict[str, _Sequence] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sequences.pop(rid, None)

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def _synced(self, request: Request) -> llguidance.LLMatcher:
        """The request's matcher, having consumed exactly its output tokens so far."""
        grammar = request.grammar
        assert isinstance(grammar, CompiledGrammar)
        seq = self._sequences.get(request.request_id)
        if seq is None or seq.num_consumed > request.num_output_tokens:
            seq = _Sequence(grammar.new_matcher())
            self._sequences[request.request_id] = seq
        missing = request.output_token_ids[seq.num_consumed :]
        if missing and not seq.matcher.consume_tokens(missing):
            logger.warning(
                "request %s: replaying its grammar failed: %s",
                request.request_id,
                seq.matcher.get_error(),
            )
        seq.num_consumed = request.num_output_tokens
        return seq.matcher

    def bitmask(self, requests: list[Request]) -> torch.Tensor | None:
        """Allowed tokens per row as packed int32 bits, or None when no row is constrained."""
        rows = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(requests), words), -1, dtype=torch.int32)
        matchers = [(self._synced(r), i) for i, r in rows]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # llguidance.torch's wrapper of this call decorates a helper with torch.compile, so
        # importing it loads TorchDynamo and Inductor: ~3.7 s of every engine start.
        self._executor.unsafe_compute_mask_ptr(
            matchers, bitmask.data_ptr(), words * 4, len(requests)
        )
        for (matcher, i), (_, request) in zip(matchers, rows, strict=True):
            if matcher.is_error():  # out of fuel, or a replay failed: let it end cleanly
                logger.warning(
                    "request %s: grammar error: %s", request.request_id, matcher.get_error()
                )
                bitmask[i] = 0
                for eos in request.eos_token_ids:
                    if eos < self.vocab_size:
                        bitmask[i, eos // 32] |= _bit(eos % 32)
        return bitmask

    def bitmask_async(self, requests: list[Request]) -> Future[torch.Tensor | None] | None:
        """``bitmask`` on a helper thread (llguidance releases the GIL, so it overlaps the
        forward pass); None, and no thread hop, when no row is constrained."""
        if all(r.grammar is None for r in requests):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-masks")
        return self._pool.submit(self.bitmask, requests)

    def draft_bitmask(self, request: Request, drafts: list[int]) -> torch.Tensor:
        """Allowed tokens at each position a speculative step verifies: after the request's
        output, then after each draft token the grammar allows. Positions past a draft it
        bans stay all ones: that draft's own mask bans it, so they are never reached. The
        matcher walks the drafts and is rolled back, so it still follows the output only."""
        matcher = self._synced(request)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
        num_valid = matcher.validate_tokens(drafts)
        num_consumed = 0
        for j in range(num_valid + 1):
            if matcher.is_stopped():
                break  # the grammar ended at the previous token: nothing after it is kept
            row = bitmask[j]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if j < num_valid:
                if not matcher.consume_token(drafts[j]):
                    break
                num_consumed += 1
        if num_consumed:
            matcher.rollback(num_consumed)
        return bitmask

    def accept(self, requests: list[Request], tokens: list[int]) -> set[str]:
        """Advance matchers by the sampled tokens; return requests whose grammar is complete."""
        ended = set()
        for request, token in zip(requests, tokens, strict=True):
            if request.grammar is None:
                continue
            seq = self._sequences.get(request.request_id)
            if seq is None:
                continue
            if seq.matcher.is_stopped() or not seq.matcher.consume_token(token):
                ended.add(request.request_id)
            seq.num_consumed += 1
            if seq.matcher.is_stopped():
                ended.add(request.request_id)
        return ended


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)
