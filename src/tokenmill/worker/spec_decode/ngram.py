"""The ``ngram`` method (vLLM's prompt lookup): proposes what followed the latest earlier
occurrence of a request's last n tokens in its own prompt and output. No model.

After each step it looks up every request that produced tokens, on its own index
(``core/ngram_index.NgramIndex``: one dict probe per n, not a scan of the history) brought
up to date with the step's new tokens, keeps the proposal, and reports its length; the next
step takes the first ``num_spec_tokens`` of it. A proposal is a prefix-consistent lookup:
its first j tokens are what a lookup for j tokens gives.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.core.messages import StepOutput
from tokenmill.core.ngram_index import NgramIndex
from tokenmill.core.request import Request
from tokenmill.core.scheduled_batch import ScheduledBatch
from tokenmill.core.speculative import max_draft_tokens
from tokenmill.worker.spec_decode.base import Proposer, ProposerContext, produced


class NgramProposer(Proposer):
    """Prompt lookup per request, kept incrementally."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}
        self._proposals: dict[str, list[int]] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> NgramProposer:
        return cls(ctx.speculative.prompt_lookup_min, ctx.speculative.prompt_lookup_max)

    def propose(self, batch: ScheduledBatch) -> None:
        for request, _ in batch.scheduled:
            if request.num_spec_tokens:
                ready = self._proposals.get(request.request_id, [])
                request.spec_token_ids = ready[: request.num_spec_tokens]
                assert len(request.spec_token_ids) == request.num_spec_tokens, (
                    "granted more draft tokens than were proposable"
                )

    def num_proposable(
        self, batch: ScheduledBatch, output: StepOutput, limit: int
    ) -> dict[str, int]:
        counts: dict[str, int] = {}
        for request, _ in batch.scheduled:  # what changed drops what it had ready
            if request.request_id in output.sampled:
                self._proposals.pop(request.request_id, None)
        if limit <= 0:
            return counts
        for request, new_tokens in produced(batch, output):
            room = max_draft_tokens(request) - len(new_tokens)  # after the new tokens
            if room > 0:
                proposal = self._lookup(request, new_tokens, min(limit, room))
                if proposal:
                    self._proposals[request.request_id] = proposal
                    counts[request.request_id] = len(proposal)
        return counts

    def _lookup(self, request: Request, new_tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after ``request``'s tokens and this step's ``new_tokens``."""
        rid = request.request_id
        index = self._indexes.get(rid)
        num = request.num_tokens
        if index is None or len(index.tokens) != num:  # new, or not what it saw: start again
            index = self._indexes[rid] = NgramIndex(self.min_n, self.max_n)
            index.extend(request.token_slice(0, num))
        index.extend(new_tokens)
        return index.propose(k)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._indexes.pop(rid, None)
            self._proposals.pop(rid, None)
