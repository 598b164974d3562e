"""The attention-backend seam: the one object a model calls for attention and its KV cache.

A backend owns three things (mini-sglang's ``attention/base.py`` and vLLM's backends are
the references):

1. ``build_metadata(batch)``: once per step, the runner's plain description of the step
   (``StepBatch``: KV slot per token and, per group of requests, token rows, positions,
   block tables and context lengths) becomes whatever tensors the backend's kernels want.
   Prefill, chunked prefill (after a cached prefix) and decode are the same description.
2. ``build_decode_metadata(...)``: the fixed-shape metadata of a decode-only batch, from
   tensors, for the compiled (and, on CUDA, graph-captured) decode step. It is called
   inside the compiled region, so it may only wrap tensors, never read them on the host.
3. ``forward(layer, q, k, v, kv_cache, meta)``: writes this step's K/V into the layer's
   cache through the slot mapping, then attends q over everything the request has in
   the cache; returns [T, num_heads * head_dim]. q and k arrive with RoPE applied;
   ``forward_rope`` takes them before RoPE, so that a backend may fuse the rotation with
   the KV write (the CPU kernels' ``rope_kv_write``).

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V tensors per layer
(``worker/kv_cache.py``), read through block tables whatever the KV strategy (paged or
static), so a backend never knows the strategy. Per-layer facts (scale, sliding window,
soft-cap, fp8 KV scales) come from the ``layer`` argument (``AttentionLayerState``).

A backend also declares what the code around it may do: ``refusal(device)`` says why it
cannot serve a device (None: it can), ``runs_decoder_layers`` whether a decode step may run
the decoder layers in one kernel call that attends the way this backend does (the fused step
runner), and ``init_capture`` is called once before the decode step is compiled or
graph-captured, for the fixed-size buffers a GPU backend keeps. The model asks its backend;
it never checks the backend's type.

Backends are chosen once, at load, by ``select_attention_backend`` (``--attention-backend``,
default: the first in ``BACKENDS`` that serves the device). Nothing here assumes a CPU: a
CUDA backend (FlashInfer, Triton paged attention) is one class decorated with
``register_attention_backend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from tokenmill import kernels
from tokenmill.model.attention import (
    FP8_DTYPES,
    AttentionGroup,
    AttentionMetadata,
    DecodeMetadata,
    _decode_kernel,
    _decode_kernel_applies,
    paged_attention,
    write_kv,
)
from tokenmill.model.layers import RotaryEmbedding


@dataclass
class BatchGroup:
    """Requests attended together: all decodes, or all multi-token chunks."""

    is_decode: bool
    token_index: list[list[int]]
    """Per request: its rows in the flat token batch."""
    query_positions: list[list[int]]
    """Per request: the absolute position of each of those rows."""
    block_tables: list[list[int]]
    """Per request: the blocks that hold its KV up to the end of this step."""
    context_lens: list[int]
    """Per request: tokens with KV after this step's writes."""


@dataclass
class StepBatch:
    """One step's layout in plain Python, as the model runner builds it (no tensors)."""

    slot_mapping: list[int]
    """Per token row: the flat KV slot (block_id * block_size + offset) its K/V go to."""
    groups: list[BatchGroup]
    num_tokens: int


class AttentionLayerState(Protocol):
    """What a backend needs from one attention layer (the decoder's ``Attention`` has it)."""

    layer_idx: int
    scale: float
    window: int | None
    """Sliding window in tokens, None for full attention."""
    logit_softcap: float | None
    kv_scales: torch.Tensor
    """[2] fp32: K and V are stored divided by these in an fp8 cache."""
    kv_scales_calibrated: bool

    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None: ...


StepMetadata = object
"""Whatever a backend's ``build_metadata`` returns; only that backend reads it."""


class AttentionBackend(ABC):
    """One attention implementation over the block-table KV cache (see the module docstring)."""

    name: ClassVar[str]
    runs_decoder_layers: ClassVar[bool] = False
    """Whether a decode step may skip ``forward`` and run every decoder layer in one kernel
    call (``model/fused_decode.py``) whose attention is this backend's. A subclass that
    overrides ``forward`` or ``forward_rope`` attends its own way, so it does not inherit a
    True here: it declares it in its own body if the fused kernel still attends as it does."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if ("forward" in own or "forward_rope" in own) and "runs_decoder_layers" not in own:
            cls.runs_decoder_layers = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def describe(self) -> str:
        """How the start-up log names this backend."""
        return f"{self.name} on {self.device}"

    @classmethod
    def refusal(cls, device: torch.device) -> str | None:
        """Why this backend cannot serve ``device``; None when it can."""
        return None

    def init_capture(self, max_batch: int, max_blocks_per_seq: int) -> None:
        """Called once before the decode step is compiled or graph-captured, with its largest
        batch and block-table width: a backend allocates its fixed-size buffers here (a CUDA
        graph replays their addresses). Nothing to do for backends that keep none."""
        return None

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> StepMetadata:
        """Tensors for one step, built once and shared by every layer."""

    @abstractmethod
    def build_decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        is_graph_captured: bool,
    ) -> StepMetadata:
        """A decode-only batch of fixed shape: one row per request, [B], [B, max_blocks], [B].

        ``is_graph_captured``: shapes and values must not be read on the host (CUDA graphs).
        """

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerState,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Write k, v [T, Hkv, D] into the cache, attend q [T, Hq, D]; returns [T, Hq * D]."""

    def forward_rope(
        self,
        layer: AttentionLayerState,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
    ) -> torch.Tensor:
        """``forward`` with q and k not yet rotated: RoPE first, unless a backend fuses it
        with the KV write."""
        q, k = rope(positions, q, k)
        return self.forward(layer, q, k, v, kv_cache, meta)


class TorchSDPABackend(AttentionBackend):
    """Plain torch: gathers K/V through block tables, one batched SDPA per group.

    Runs on any device torch runs on; on CPU it is the default, and there tokenmill's
    kernels attend decodes and prompt chunks over the blocks in place. The compiled decode step
    goes through the ``tokenmill::decode_attention`` custom op, which torch.compile treats
    as opaque (it mutates the cache in place and trims to the longest context).
    """

    name = "torch_sdpa"
    runs_decoder_layers = True  # decode_layers attends with the same CPU kernel as forward_rope

    def describe(self) -> str:
        if self.device.type != "cpu":
            return super().describe()
        kernels_in_use = (
            f"tokenmill CPU kernels {kernels.active_isa()}"
            if kernels.available()
            else "torch kernels only"
        )
        return f"{super().describe()} ({kernels_in_use})"

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._tensor(batch.slot_mapping),
            groups=[self._build_group(g) for g in batch.groups],
            num_tokens=batch.num_tokens,
        )

    def _build_group(self, group: BatchGroup) -> AttentionGroup:
        """Pad one group's rows to rectangles: padding repeats a valid row and is masked."""
        rows, positions = group.token_index, group.query_positions
        max_q = max(len(r) for r in rows)
        max_blocks = max(len(t) for t in group.block_tables)
        return AttentionGroup(
            token_index=self._tensor([r + [r[-1]] * (max_q - len(r)) for r in rows]),
            valid=self._tensor(
                [[True] * len(r) + [False] * (max_q - len(r)) for r in rows], torch.bool
            ),
            block_tables=self._tensor(
                [t + [0] * (max_blocks - len(t)) for t in group.block_tables]
            ),
            query_positions=self._tensor([p + [p[-1]] * (max_q - len(p)) for p in positions]),
            context_lens=self._tensor(group.context_lens),
            is_decode=group.is_decode,
            segments=_segments(group),
        )

    def build_decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        is_graph_captured: bool,
    ) -> DecodeMetadata:
        return DecodeMetadata(
            slot_mapping, block_tables, context_lens, trim_to_longest=not is_graph_captured
        )

    def forward(
        self,
        layer: AttentionLayerState,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        softcap = layer.logit_softcap or 0.0
        if isinstance(meta, DecodeMetadata):
            out: torch.Tensor = torch.ops.tokenmill.decode_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                layer.scale,
                layer.window or 0,
                meta.trim_to_longest,
                layer.kv_scales,
                softcap,
            )
            return out
        if not isinstance(meta, AttentionMetadata):
            raise TypeError(f"{self.name}: metadata of another backend ({type(meta).__name__})")
        if k_cache.dtype in FP8_DTYPES and not layer.kv_scales_calibrated:
            layer.calibrate_kv_scales(k, v, k_cache.dtype)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer.kv_scales)
        return paged_attention(
            q, k_cache, v_cache, meta, layer.scale, layer.window, layer.kv_scales, softcap
        )

    def forward_rope(
        self,
        layer: AttentionLayerState,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
    ) -> torch.Tensor:
        """On tokenmill's CPU kernels, RoPE and the KV write run as one op, then attention;
        in the compiled decode step too (the op declares its cache mutations, so
        torch.compile traces it and the decode kernel after it)."""
        k_cache, v_cache = kv_cache
        compiled_decode = isinstance(meta, DecodeMetadata) and _decode_kernel_applies(q, k_cache)
        if not (
            (isinstance(meta, AttentionMetadata) or compiled_decode)
            and _fused_rope_applies(layer, rope, q, k_cache)
        ):
            return super().forward_rope(layer, positions, rope, q, k, v, kv_cache, meta)
        assert isinstance(meta, (AttentionMetadata, DecodeMetadata))
        q = kernels.rope_kv_write(
            positions,
            q,
            k,
            v,
            rope.cos,
            rope.sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            layer.kv_scales,
        )
        softcap = layer.logit_softcap or 0.0
        if isinstance(meta, DecodeMetadata):
            return _decode_kernel(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                layer.scale,
                layer.window,
                layer.kv_scales,
                softcap,
            )
        return paged_attention(
            q, k_cache, v_cache, meta, layer.scale, layer.window, layer.kv_scales, softcap
        )


def _fused_rope_applies(
    layer: AttentionLayerState, rope: RotaryEmbedding, q: torch.Tensor, k_cache: torch.Tensor
) -> bool:
    """Where the RoPE kernel runs (bf16 or fp32 on CPU, every dim rotated), the fused op does too;
    an fp8 cache only once its scales are calibrated (from the first rotated K)."""
    return (
        kernels.supports(q, float32=True)
        and rope.cos.device.type == "cpu"
        and not rope.is_partial
        and k_cache.device.type == "cpu"
        and (k_cache.dtype not in FP8_DTYPES or layer.kv_scales_calibrated)
    )


def _segments(group: BatchGroup) -> list[tuple[int, int, int]] | None:
    """(first row, queries, context) per request if each request's rows are consecutive and
    its queries are the last positions of its context (what ``paged_attention``'s causal
    chunk path needs); None otherwise."""
    out = []
    for rows, pos, ctx in zip(
        group.token_index, group.query_positions, group.context_lens, strict=True
    ):
        n = len(rows)
        if n == 0 or rows != list(range(rows[0], rows[0] + n)) or pos != list(range(ctx - n, ctx)):
            return None
        out.append((rows[0], n, ctx))
    return out


BACKENDS: dict[str, type[AttentionBackend]] = {}
"""Attention backends by name, in order of preference (``auto`` takes the first that serves
the device)."""


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Add a backend under its ``name`` (a class decorator): the one step a new backend needs."""
    if cls.name in BACKENDS and BACKENDS[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} is registered already")
    BACKENDS[cls.name] = cls
    return cls


register_attention_backend(TorchSDPABackend)


def select_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` for ``device`` (None or ``auto``: the first registered one
    that serves it); raises ValueError naming the choices or the reason it cannot."""
    if name is None or name == "auto":
        for cls in BACKENDS.values():
            if cls.refusal(device) is None:
                return cls(device)
        raise ValueError(f"no attention backend serves {device}")
    chosen = BACKENDS.get(name)
    if chosen is None:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}"
        )
    reason = chosen.refusal(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot serve {device}: {reason}")
    return chosen(device)


def default_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend ``auto`` selects for ``device``."""
    return select_attention_backend(None, device)
