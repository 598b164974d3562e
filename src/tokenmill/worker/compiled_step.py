"""CompiledDecodeStep: a fixed-shape decode forward per batch-size bucket.

The ``static`` strategy's speed half (TensorRT-LLM's trade): at start-up the decode
forward is compiled for each bucket with ``torch.compile`` (inductor fuses RMSNorm with
its residual add, RoPE and SwiGLU; on CPU into C++ loops), and on CUDA additionally
captured as one CUDA graph per bucket and replayed. A decode-only step is padded up to
the next bucket: padding rows write their K/V into a scratch block nobody reads. Steps
with prefill chunks, prompt logprobs, LoRA adapter rows or more rows than the largest
bucket run eagerly.

Each bucket of each engine compiles its own copy of the forward's code object: dynamo keeps
compiled graphs, and counts recompiles against its limit (8), per code object, so engines in
one process, and the buckets of one engine (9 on CUDA up to 256), never count against each
other. A bucket that cannot be compiled runs eagerly, with a warning.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
from tqdm import tqdm

from tokenmill.model.base import CausalLM

logger = logging.getLogger(__name__)

DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def _compile_errors() -> tuple[type[Exception], ...]:
    """What a compiled call raises when dynamo or inductor, not the model, failed. Read when
    needed: touching ``torch._dynamo`` imports it (~1.7 s), and most engines never compile."""
    return (
        torch._dynamo.exc.TorchDynamoException,
        torch._dynamo.exc.FailOnRecompileLimitHit,
    )


def _inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache so far in this process."""
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


def _cache_state(before: tuple[int, int], after: tuple[int, int]) -> str:
    """``cold`` if any graph was compiled from scratch, ``warm`` if all came from the cache."""
    hits, misses = after[0] - before[0], after[1] - before[1]
    if misses:
        return "cold"
    return "warm" if hits else "unknown"


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
        model: CausalLM,
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
        self.device = device
        self.use_cuda_graphs = device.type == "cuda"
        self._fns: dict[int, DecodeFn] = {}
        self.eager_buckets: list[int] = []
        """Requested buckets that could not be compiled; their batches run eagerly."""
        self.compile_s_by_bucket: dict[int, float] = {}
        """Seconds each bucket took to compile (and capture), failed ones included."""
        self.cache_by_bucket: dict[int, str] = {}
        """Per bucket: ``warm`` if inductor's FX graph cache served it, ``cold`` or ``unknown``."""
        start = time.monotonic()
        for bucket in tqdm(sorted(set(buckets)), desc="Compiling decode buckets", unit="bucket"):
            bucket_start, cache_before = time.monotonic(), _inductor_cache_counts()
            try:
                self._fns[bucket] = self._capture(bucket, self._compile_forward())
            except Exception as exc:  # any compiler failure: the model still runs, eagerly
                self._fall_back_to_eager(bucket, exc, "could not compile")
            self.compile_s_by_bucket[bucket] = time.monotonic() - bucket_start
            self.cache_by_bucket[bucket] = _cache_state(cache_before, _inductor_cache_counts())
            logger.info(
                "compiled decode bucket %d in %.2fs (compile cache %s)",
                bucket,
                self.compile_s_by_bucket[bucket],
                self.cache_by_bucket[bucket],
            )
        self.compile_time_s = time.monotonic() - start
        logger.info(
            "compiled decode for batch sizes %s in %.1fs", self.buckets, self.compile_time_s
        )

    @property
    def buckets(self) -> list[int]:
        """Batch sizes with a compiled forward, ascending."""
        return sorted(self._fns)

    @property
    def max_batch(self) -> int:
        """Largest decode batch the compiled forwards take; 0 when none compiled."""
        return max(self._fns, default=0)

    def _fall_back_to_eager(self, bucket: int, exc: BaseException, what: str) -> None:
        self._fns.pop(bucket, None)
        self.eager_buckets.append(bucket)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        logger.warning(
            "%s the decode forward for batch size %d (%s: %s); such batches run eagerly",
            what,
            bucket,
            type(exc).__name__,
            first_line,
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        meta = self.model.attn_backend.build_decode_metadata(
            slots, block_tables, context_lens, is_graph_captured=self.use_cuda_graphs
        )
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _compile_forward(self) -> DecodeFn:
        """``torch.compile`` of ``_forward`` bound to a private copy of its code object."""
        fn = CompiledDecodeStep._forward
        private = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        return torch.compile(types.MethodType(private, self), dynamic=False, fullgraph=True)

    def _dummy_inputs(self, bucket: int) -> list[torch.Tensor]:
        return [
            torch.zeros(bucket, dtype=torch.long, device=self.device),
            torch.zeros(bucket, dtype=torch.long, device=self.device),
            torch.full(
                (bucket,),
                self.scratch_block * self.block_size,
                dtype=torch.long,
                device=self.device,
            ),
            torch.full(
                (bucket, self.max_blocks), self.scratch_block, dtype=torch.long, device=self.device
            ),
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

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
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
        try:
            return self._fns[bucket](*args)[:batch]
        except _compile_errors() as exc:  # e.g. a guard failed and recompiling failed
            self._fall_back_to_eager(bucket, exc, "could not recompile")
            with torch.inference_mode():  # the same padded forward, so the same hidden states
                return self._forward(*args)[:batch]
