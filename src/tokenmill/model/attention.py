"""Paged attention in plain torch: write K/V through the slot mapping, read through block tables.

One step mixes decode tokens (one query each) and prefill chunks (many queries, possibly
after a cached prefix). Each group is one batched ``scaled_dot_product_attention`` call over
K/V gathered from the block tables; grouped-query attention folds the query heads of a KV
head into extra query rows, so K/V are never repeated. Per-step data arrives as an explicit
``AttentionMetadata`` built by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Requests attended with one batched call (all decodes, or all prefill chunks)."""

    token_index: torch.Tensor
    """[B, max_q] rows of the flat token batch (padding rows repeat a valid row)."""
    valid: torch.Tensor
    """[B, max_q] bool, False on padding."""
    block_tables: torch.Tensor
    """[B, max_blocks] block ids (padding points at block 0; masked out)."""
    query_positions: torch.Tensor
    """[B, max_q] absolute position of each query."""
    context_lens: torch.Tensor
    """[B] tokens with KV after this step's writes."""
    is_decode: bool
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """Per sliding window (None = full): [B, 1, max_q, max_kv] bool, True = attend."""

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            max_kv = self.block_tables.shape[1] * block_size
            kv_pos = torch.arange(max_kv, device=self.context_lens.device)
            q_pos = self.query_positions[:, :, None]
            allowed = (kv_pos[None, None, :] <= q_pos) & (kv_pos[None, None, :] < self.context_lens[:, None, None])
            if window is not None:
                allowed &= kv_pos[None, None, :] > q_pos - window
            self.masks[window] = allowed.unsqueeze(1)
        return self.masks[window]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once per step by the runner."""

    slot_mapping: torch.Tensor
    """[T] flat KV slot (block_id * block_size + offset) for each token's K/V."""
    groups: list[AttentionGroup]
    num_tokens: int


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's K/V [T, Hkv, D] into caches shaped [num_blocks, block_size, Hkv, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of queries q [T, Hq, D] over the cached K/V; returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in meta.groups:
        batch, max_q = group.token_index.shape
        # K/V: [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
        keys = k_cache[group.block_tables].flatten(1, 2).transpose(1, 2)
        values = v_cache[group.block_tables].flatten(1, 2).transpose(1, 2)
        # Queries: [B, max_q, Hkv, G, D] -> [B, Hkv, G * max_q, D]
        qg = q[group.token_index].view(batch, max_q, num_kv_heads, group_size, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group_size * max_q, head_dim)
        mask = group.mask(window, block_size)
        if max_q > 1:
            mask = mask.unsqueeze(2).expand(-1, -1, group_size, -1, -1).reshape(batch, 1, group_size * max_q, -1)
        attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        attn = attn.view(batch, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
        attn = attn.reshape(batch * max_q, num_heads * head_dim)
        if group.is_decode:
            out[group.token_index.view(-1)] = attn
        else:
            valid = group.valid.view(-1)
            out[group.token_index.view(-1)[valid]] = attn[valid]
    return out
