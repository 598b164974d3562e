"""Python entry points to the C++ ops of attention and of the fused decode step: RoPE (alone,
fused with the KV-cache write, or from a qkv projection's rows with the q/k norms), paged
decode and prompt attention, and ``decode_layers`` with the ``DecodeLayers`` object it runs
(the linear, norm and activation ops are in ``kernels/ops.py``; fakes for torch.compile in
``kernels/fakes.py``).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] by fp32 tables [P, D]."""
    return torch.ops.tokenmill_cpu.rope(positions, q, k, cos, sin)


def rope_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
) -> torch.Tensor:
    """RoPE of q [T, Hq, D] and k [T, Hk, D], with the rotated k and v [T, Hk, D] stored into
    the caches [blocks, block_size, Hk, D] at ``slot_mapping`` [T] (fp8 caches: divided by
    ``kv_scales`` [k, v] and saturated, as ``model.attention.write_kv``); returns the rotated
    q [T, Hq, D]. One op instead of RoPE, two conversions and two index copies."""
    return torch.ops.tokenmill_cpu.rope_kv_write(
        positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, kv_scales
    )


def qkv_rope_kv_write(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    q_eps: float,
    k_norm: torch.Tensor | None,
    k_eps: float,
    norm_offset: bool,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The decode step's attention prologue from a qkv projection's rows [T, (Hq + 2 Hk) D]
    as they lie: each head's RMSNorm of q and k (weights [D], or None for none; ``norm_offset``
    scales by 1 + weight), RoPE, and k and v stored into caches of the activation dtype at the
    int64 ``slots``; returns the rotated q [T, Hq, D]. The bits of narrowing qkv, ``rms_norm``
    on each head and ``rope_kv_write``, in one parallel region over the tokens."""
    return torch.ops.tokenmill_cpu.qkv_rope_kv_write(
        qkv,
        num_heads,
        num_kv_heads,
        head_dim,
        q_norm,
        q_eps,
        k_norm,
        k_eps,
        norm_offset,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    kv_scales: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per row q [B, Hq, D] over the blocks in place; returns [B, Hq * D].

    ``window`` 0 is full attention; ``softcap`` > 0 caps scores as c * tanh(s / c)."""
    return torch.ops.tokenmill_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, window, kv_scales, softcap
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int,
    kv_scales: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Prefill chunks over the blocks in place; returns [N, Hq * D].

    Sequence b's queries are rows ``query_start[b] : query_start[b + 1]`` of q [N, Hq, D],
    its last positions (a prompt chunk after whatever it has cached); they attend its first
    ``context_lens[b]`` cached tokens causally. ``window`` 0 is full attention; ``softcap``
    > 0 caps scores as c * tanh(s / c)."""
    return torch.ops.tokenmill_cpu.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start,
        scale,
        window,
        kv_scales,
        softcap,
    )


class DecodeLayers(Protocol):
    """The C++ side's ``tokenmill_cpu.DecodeLayers`` (a torch custom class, ops_decode.cpp):
    the layers ``decode_layers`` runs, each field given by name and read once."""

    def add_layer(
        self,
        tensors: dict[str, torch.Tensor],
        ints: dict[str, int],
        floats: dict[str, float],
        strings: dict[str, str],
    ) -> None:
        """Append a layer: its norm weights and eps, KV scales, head counts, window, scale,
        softcap and activation, each under its name (an unknown or missing name is an error;
        an optional one, such as a q/k norm, is left out where the layer has none)."""

    def add_projection(
        self, name: str, op: str, tensors: dict[str, torch.Tensor], ints: dict[str, int]
    ) -> None:
        """Set the last layer's projection ``name`` (qkv, o, gate_up, down): a call of the
        tokenmill op ``op`` with these arguments after x, under their schema names (an
        absent optional argument, such as a bias, is left out)."""

    def num_layers(self) -> int: ...

    def handle(self) -> int:
        """The int that names this object to ``decode_layers`` while it is alive (passing
        the object itself would cost ~15 us a call in argument parsing)."""


def decode_layers_object() -> DecodeLayers:
    """An empty ``DecodeLayers`` for ``decode_layers``."""
    return cast(DecodeLayers, torch.classes.tokenmill_cpu.DecodeLayers())


def op_argument_names(op: str) -> list[str]:
    """The names of a tokenmill op's arguments after x, from its registered schema."""
    schema = getattr(torch.ops.tokenmill_cpu, op).default._schema
    return [arg.name for arg in schema.arguments[1:]]


def decode_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    layers: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step through a stack of decoder layers, as ``model.fused_decode``
    encodes them (``layers``: the ``handle`` of a filled ``decode_layers_object``, which the
    caller keeps alive); one query row per sequence of x [B, hidden]. Returns (x, residual) after the last layer, before the final norm."""
    out: tuple[torch.Tensor, torch.Tensor] = torch.ops.tokenmill_cpu.decode_layers(
        x,
        None,
        positions,
        cos,
        sin,
        slot_mapping,
        block_tables,
        context_lens,
        k_caches,
        v_caches,
        layers,
    )
    return out
