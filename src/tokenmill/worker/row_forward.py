"""RowForward: a forward over decode-shaped rows, compiled where a bucket fits, else eager.

A decode-shaped row is one token that attends to every position of its request up to its
own. The decode attention op writes every row's K/V before any row attends, so several rows
of one request (a verification's last token and drafts, a draft model's two-token catch-up)
are decode rows too: row i sees the rows before it. Such a step needs no prefill-style
metadata (no query groups, no causal mask, no gather of the cached keys), which on a small
model is most of what a step costs besides the GEMVs.

The ``static`` strategy's ``CompiledDecodeStep`` runs these rows through its fixed-shape
graphs; without one (the ``paged`` strategy, ``--enforce-eager``) the same rows run eagerly
with the backend's decode metadata. Speculative decoding uses it for the paged strategy's
verification steps and for every forward of the draft model.
"""

from __future__ import annotations

import torch

from tokenmill.model.base import CausalLM
from tokenmill.worker.compiled_step import CompiledDecodeStep


class RowForward:
    """Hidden states for decode-shaped rows: ``compiled`` when it takes the batch, else eager."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scratch_block: int,
        device: torch.device,
        compiled: CompiledDecodeStep | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        """A block nobody reads: it pads the rows' block tables to one width."""
        self.device = device
        self.compiled = compiled
        self.num_compiled = 0
        """Forwards that ran compiled (tests check the compiled path is the one taken)."""
        self.num_eager = 0

    @staticmethod
    def supports(model: CausalLM) -> bool:
        """Whether the model's forward takes decode metadata (not MoE or the fallback)."""
        return model.supports_compiled_decode

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states [rows, hidden], one row per token (its K/V written at its slot)."""
        compiled = self.compiled
        if compiled is not None and len(input_ids) <= compiled.max_batch:
            self.num_compiled += 1
            return compiled.run(input_ids, positions, slots, block_tables)
        self.num_eager += 1
        width = max(len(t) for t in block_tables)
        tables = [t + [self.scratch_block] * (width - len(t)) for t in block_tables]
        device = self.device
        meta = self.model.attn_backend.build_decode_metadata(
            torch.tensor(slots, device=device),
            torch.tensor(tables, device=device),
            torch.tensor([p + 1 for p in positions], device=device),
            is_graph_captured=False,
        )
        ids = torch.tensor(input_ids, device=device)
        return self.model(ids, torch.tensor(positions, device=device), self.kv_caches, meta)
