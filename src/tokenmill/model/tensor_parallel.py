"""Tensor parallelism (Megatron's split) for the shared decoder, on ``torch.distributed``.

Each rank holds a slice of every big weight and reads only that slice from the checkpoint:
q/k/v and gate/up are column-parallel (a rank owns whole heads and a slice of the
intermediate size), o and down row-parallel (the matching input columns; their bias on
rank 0 only), each followed by one all-reduce (a forward hook on the attention and MLP
modules, so the model code is unchanged); OLMo 2's q/k norm over all heads all-reduces
its sum of squares (``AllHeadsRMSNorm``); KV heads are split, or replicated when there are
fewer KV heads than ranks (rank r keeps the head its query heads read). MoE experts are
split the same way inside each expert, with one all-reduce after the whole sparse MLP.
Embedding and LM head are vocab-parallel: a rank owns ``ceil(V / tp)`` rows plus one zero
row that ids outside its range look up, the embeddings are summed over ranks and the
logits gathered. The same calls run on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.model.config import ModelConfig
from tokenmill.model.layers import RMSNorm
from tokenmill.model.registry import WeightSpec

ReadRows = Callable[[str, int, int], torch.Tensor]
"""(checkpoint tensor name, first row, end row) -> those rows, in the load dtype."""


@dataclass(frozen=True)
class TPShard:
    """This rank's place in the tensor-parallel group."""

    rank: int
    world_size: int


def check_supported(cfg: ModelConfig, tp: int) -> None:
    """ConfigError naming what does not split ``tp`` ways."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.is_moe and cfg.moe_intermediate_size % tp:
        problems.append(f"expert intermediate size {cfg.moe_intermediate_size}")
    if cfg.shared_expert_intermediate_size % tp:
        problems.append(f"shared expert size {cfg.shared_expert_intermediate_size}")
    if problems:
        raise ConfigError(
            f"--tensor-parallel-size {tp} does not divide {cfg.architecture}'s "
            f"{', '.join(problems)}"
        )


def vocab_rows(cfg: ModelConfig, shard: TPShard) -> tuple[int, int, int]:
    """(first id, ids owned, rows per rank) of this rank's vocabulary slice."""
    per_rank = -(-cfg.vocab_size // shard.world_size)
    start = min(cfg.vocab_size, shard.rank * per_rank)
    return start, min(cfg.vocab_size, start + per_rank) - start, per_rank


def kv_heads(cfg: ModelConfig, shard: TPShard) -> tuple[int, int]:
    """(first KV head, KV heads held) on this rank."""
    if cfg.num_kv_heads >= shard.world_size:
        n = cfg.num_kv_heads // shard.world_size
        return shard.rank * n, n
    return shard.rank * cfg.num_kv_heads // shard.world_size, 1  # replicated


def shard_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The sizes one rank's modules are built with (the model keeps the full config)."""
    tp = shard.world_size
    return replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=kv_heads(cfg, shard)[1],
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=vocab_rows(cfg, shard)[2] + 1,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
    )


def _row_ranges(spec: WeightSpec, cfg: ModelConfig, shard: TPShard) -> list[tuple[int, int]]:
    """Rows of the logical [q|k|v] or [gate|up] tensor this rank keeps."""
    d, r, tp = cfg.head_dim, shard.rank, shard.world_size
    if ".attn.qkv." in spec.target:
        q = cfg.num_heads // tp
        k0, nk = kv_heads(cfg, shard)
        qs, kvs = cfg.q_size, cfg.kv_size
        return [
            (r * q * d, (r + 1) * q * d),
            (qs + k0 * d, qs + (k0 + nk) * d),
            (qs + kvs + k0 * d, qs + kvs + (k0 + nk) * d),
        ]
    inter = spec.shape[0] // 2  # [gate|up]
    part = inter // tp
    return [(r * part, (r + 1) * part), (inter + r * part, inter + (r + 1) * part)]


def read_shard(
    spec: WeightSpec, cfg: ModelConfig, shard: TPShard, dtype: torch.dtype, read_rows: ReadRows
) -> torch.Tensor:
    """This rank's slice of one (fused) parameter, reading only its rows where it can
    (a row-parallel weight's columns come from one source tensor read whole, then narrowed)."""
    target = spec.target
    if target in ("embed", "lm_head.weight"):
        start, owned, per_rank = vocab_rows(cfg, shard)
        out = torch.zeros(per_rank + 1, *spec.shapes[0][1:], dtype=dtype)
        if owned:
            out[:owned] = read_rows(spec.sources[0], start, start + owned)
        return out
    if target.endswith((".attn.qkv.weight", ".attn.qkv.bias", ".gate_up.weight", ".gate_up.bias")):
        offsets, row = [], 0
        for shape in spec.shapes:  # where each source starts in the logical tensor
            offsets.append(row)
            row += shape[0]
        pieces = []
        for lo, hi in _row_ranges(spec, cfg, shard):
            i = max(j for j, off in enumerate(offsets) if off <= lo)
            pieces.append(read_rows(spec.sources[i], lo - offsets[i], hi - offsets[i]))
        return torch.cat(pieces)
    if target.endswith((".attn.o.weight", ".down.weight")):
        full = read_rows(spec.sources[0], 0, spec.shapes[0][0])
        cols = full.shape[1] // shard.world_size
        return full[:, shard.rank * cols : (shard.rank + 1) * cols].contiguous()
    if cfg.qk_norm == "full" and target.endswith(".attn.q_norm.weight"):
        q = cfg.num_heads // shard.world_size * cfg.head_dim
        return read_rows(spec.sources[0], shard.rank * q, (shard.rank + 1) * q)
    if cfg.qk_norm == "full" and target.endswith(".attn.k_norm.weight"):
        k0, nk = kv_heads(cfg, shard)
        return read_rows(spec.sources[0], k0 * cfg.head_dim, (k0 + nk) * cfg.head_dim)
    if target.endswith((".attn.o.bias", ".down.bias")):
        full = read_rows(spec.sources[0], 0, spec.shapes[0][0])
        return full if shard.rank == 0 else torch.zeros_like(full)  # added once
    return torch.cat(
        [
            read_rows(name, 0, shape[0])
            for name, shape in zip(spec.sources, spec.shapes, strict=True)
        ]
    )


def _all_reduce_output(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


class AllHeadsRMSNorm(nn.Module):
    """OLMo 2's q/k RMSNorm over every head when this rank holds only some: the local sum
    of squares is all-reduced (one small all-reduce), then the local weight slice scales.
    Replicated KV heads are counted once per rank holding them, which the divisor matches
    (``local size * world size`` elements were summed either way)."""

    def __init__(self, norm: RMSNorm, world_size: int) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.offset = norm.offset
        self.world_size = world_size

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.to(torch.float32)
        sumsq = x32.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(sumsq)
        x32 = x32 * torch.rsqrt(sumsq / (x.shape[-1] * self.world_size) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype), x
        return self.weight * x32.to(x.dtype), x


def parallelize(model: nn.Module, cfg: ModelConfig, shard: TPShard) -> None:
    """Install the collectives on a loaded rank model: sum embeddings, attention and MLP
    outputs over ranks, gather the logits."""
    start, owned, per_rank = vocab_rows(cfg, shard)
    layers = list(model.layers)  # type: ignore[arg-type]

    def local_ids(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        is_mine = (ids >= start) & (ids < start + owned)
        return (torch.where(is_mine, ids - start, per_rank), *args[1:])  # row per_rank is zero

    def sum_embeddings(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        dist.all_reduce(args[0])
        return args

    def gather_logits(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(output) for _ in range(shard.world_size)]
        dist.all_gather(parts, output.contiguous())
        counts = [vocab_rows(cfg, TPShard(r, shard.world_size))[1] for r in range(shard.world_size)]
        return torch.cat([p[..., :n] for p, n in zip(parts, counts, strict=True)], dim=-1)

    model.register_forward_pre_hook(local_ids)
    layers[0].register_forward_pre_hook(sum_embeddings)
    for layer in layers:
        if cfg.qk_norm == "full":
            attn = layer.attn
            assert isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
            attn.q_norm = AllHeadsRMSNorm(attn.q_norm, shard.world_size)
            attn.k_norm = AllHeadsRMSNorm(attn.k_norm, shard.world_size)
        layer.attn.register_forward_hook(_all_reduce_output)
        layer.mlp.register_forward_hook(_all_reduce_output)
    model.lm_head.register_forward_hook(gather_logits)  # type: ignore[union-attr]
