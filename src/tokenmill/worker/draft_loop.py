"""CompiledDraftLoop: all of a step's draft forwards as one compiled graph.

A draft proposes its k tokens one forward at a time: the first reads its catch-up (the
tokens it has not seen: one after a rejection, two when every draft was accepted), each
later one the previous argmax. Run forward by forward, every one pays the host side
of a step (rows laid out in Python, five input tensors built, the compiled call's guards,
the head and argmax dispatched eagerly, a ``.tolist()`` to read the token back); on a
one-layer draft of the demo's size that costs about as much as the layer itself. Here the
whole chain (slot from the block table, decode attention, head, argmax, next position)
is unrolled into one ``torch.compile`` graph per batch bucket and catch-up length: one
call per engine step returns every draft token.

Exactness does not depend on it: the draft's tokens are proposals, and verification keeps
only what the target would produce. Padding rows attend to, and write into, the scratch
block (positions 0 .. first_rows + steps - 2, below a block's size).
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch

from tokenmill.model.base import CausalLM

logger = logging.getLogger(__name__)

LoopFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CompiledDraftLoop:
    """``num_steps`` greedy draft forwards, the first of ``first_rows`` rows per request
    (its catch-up), the others of one, compiled per bucket."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        num_steps: int,
        buckets: list[int],
        device: torch.device,
        first_rows: int = 1,
    ) -> None:
        if num_steps < 1 or first_rows < 1 or first_rows + num_steps - 1 > block_size:
            raise ValueError(f"{first_rows} + {num_steps} - 1 rows do not fit a block")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.num_steps = num_steps
        """Forwards per call: the drafts it proposes per request."""
        self.first_rows = first_rows
        """Rows per request in the first forward: the catch-up's length."""
        self.device = device
        self._fns: dict[int, LoopFn] = {}
        self.num_calls = 0
        """Calls that ran (tests check the loop is the path taken)."""
        start = time.monotonic()
        for bucket in sorted(set(buckets)):
            try:
                fn = self._compile()
                fn(*self._dummy_inputs(bucket))  # compile now, with padding-only rows
                self._fns[bucket] = fn
            except Exception as exc:  # any compiler failure: the per-forward rows still run
                logger.warning(
                    "could not compile the draft loop for %d rows (%s); those run per forward",
                    bucket,
                    type(exc).__name__,
                )
        self.compile_time_s = time.monotonic() - start

    @property
    def max_batch(self) -> int:
        """Most requests one call takes; 0 when nothing compiled."""
        return max(self._fns, default=0)

    def _loop(
        self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """[num_steps, B] tokens: step 0 reads ``input_ids`` (``first_rows`` per request, in
        request order), step i the argmax of step i - 1."""
        bs, rows = self.block_size, self.first_rows
        out = []
        ids, pos = input_ids, positions
        tables = block_tables.repeat_interleave(rows, dim=0) if rows > 1 else block_tables
        for step in range(self.num_steps):
            block = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
            meta = self.model.attn_backend.build_decode_metadata(
                block * bs + pos % bs, tables, pos + 1, is_graph_captured=False
            )
            hidden = self.model(ids, pos, self.kv_caches, meta)
            if step == 0 and rows > 1:  # the catch-up: each request's last row proposes
                hidden, pos, tables = hidden[rows - 1 :: rows], pos[rows - 1 :: rows], block_tables
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            out.append(ids)
            pos = pos + 1
        return torch.stack(out)

    def _compile(self) -> LoopFn:
        """``torch.compile`` of ``_loop`` on a private code object (dynamo's recompile limit
        counts per code object, so buckets and engines never count against each other)."""
        fn = CompiledDraftLoop._loop
        private = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        return torch.compile(types.MethodType(private, self), dynamic=False, fullgraph=True)

    def _dummy_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device, rows = self.device, self.first_rows
        return (
            torch.zeros(bucket * rows, dtype=torch.long, device=device),
            torch.arange(rows, device=device).repeat(bucket),
            torch.full(
                (bucket, self.max_blocks), self.scratch_block, dtype=torch.long, device=device
            ),
        )

    @torch.inference_mode()
    def run(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        """Per request, the ``num_steps`` tokens that follow its ``first_rows`` input tokens
        (``input_ids`` and ``positions`` hold them request after request)."""
        rows = self.first_rows
        batch = len(block_tables)
        bucket = next(b for b in sorted(self._fns) if b >= batch)
        pad = bucket - batch
        width = self.max_blocks
        tables = [t + [self.scratch_block] * (width - len(t)) for t in block_tables]
        tables += [[self.scratch_block] * width] * pad
        device = self.device
        self.num_calls += 1
        tokens = self._fns[bucket](
            torch.tensor(input_ids + [0] * (pad * rows), device=device),
            torch.tensor(positions + list(range(rows)) * pad, device=device),
            torch.tensor(tables, device=device),
        )
        drafts: list[list[int]] = tokens[:, :batch].T.tolist()
        return drafts
