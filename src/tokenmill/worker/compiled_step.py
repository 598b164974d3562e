"""CompiledDecodeStep: a fixed-shape decode forward per batch-size bucket.

The ``static`` strategy's speed half (TensorRT-LLM's trade): at start-up the decode
forward is compiled for each bucket with ``torch.compile`` (inductor fuses RMSNorm with
its residual add, RoPE and SwiGLU; on CPU into C++ loops), and on CUDA additionally
captured as one CUDA graph per bucket and replayed. A decode-only step is padded up to
the next bucket: padding rows write their K/V into a scratch block nobody reads. Steps
with prefill chunks, prompt logprobs or more rows than the largest bucket run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from tokenmill.model.attention import DecodeMetadata
from tokenmill.model.decoder import DecoderModel

logger = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_buckets(max_num_seqs: int, device: torch.device) -> list[int]:
    """Powers of two up to max_num_seqs (CPU stops at 32 to bound compile time)."""
    limit = max_num_seqs if device.type == "cuda" else min(max_num_seqs, 32)
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= limit]
    if limit not in buckets:
        buckets.append(limit)
    return buckets


class CompiledDecodeStep:
    """Compiled (and on CUDA graph-captured) decode forwards, one per batch bucket."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        buckets: list[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.buckets = sorted(set(buckets))
        self.device = device
        self.use_cuda_graphs = device.type == "cuda"
        self._fns: dict[int, DecodeFn] = {}
        self.compile_time_s = 0.0
        compiled = torch.compile(self._forward, dynamic=False, fullgraph=True)
        start = time.monotonic()
        for bucket in tqdm(self.buckets, desc="Compiling decode buckets", unit="bucket"):
            self._fns[bucket] = self._capture(bucket, compiled)
        self.compile_time_s = time.monotonic() - start
        logger.info("compiled decode for batch sizes %s in %.1fs", self.buckets, self.compile_time_s)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor,
    ) -> torch.Tensor:
        meta = DecodeMetadata(slots, block_tables, context_lens, trim_to_longest=not self.use_cuda_graphs)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _dummy_inputs(self, bucket: int) -> list[torch.Tensor]:
        return [
            torch.zeros(bucket, dtype=torch.long, device=self.device),
            torch.zeros(bucket, dtype=torch.long, device=self.device),
            torch.full((bucket,), self.scratch_block * self.block_size, dtype=torch.long, device=self.device),
            torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.long, device=self.device),
            torch.ones(bucket, dtype=torch.long, device=self.device),
        ]

    @torch.inference_mode()
    def _capture(self, bucket: int, compiled: DecodeFn) -> DecodeFn:
        inputs = self._dummy_inputs(bucket)
        if not self.use_cuda_graphs:
            compiled(*inputs)  # compile now, with padding-only rows
            return compiled
        # CUDA: warm up (and compile) on a side stream before capture, as PyTorch requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                compiled(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = compiled(*inputs)

        def replay(*args: torch.Tensor) -> torch.Tensor:
            for static, value in zip(inputs, args, strict=True):
                static.copy_(value)
            graph.replay()
            return output

        return replay

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [B, hidden] for B decode rows (B <= max_batch)."""
        batch = len(input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        pad = bucket - batch
        tables = [t + [self.scratch_block] * (self.max_blocks - len(t)) for t in block_tables]
        tables += [[self.scratch_block] * self.max_blocks] * pad
        args = [
            torch.tensor(input_ids + [0] * pad, device=self.device),
            torch.tensor(positions + [0] * pad, device=self.device),
            torch.tensor(slots + [self.scratch_block * self.block_size] * pad, device=self.device),
            torch.tensor(tables, device=self.device),
            torch.tensor([p + 1 for p in positions] + [1] * pad, device=self.device),
        ]
        return self._fns[bucket](*args)[:batch]
