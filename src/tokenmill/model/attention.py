"""Paged attention in plain torch: write K/V through the slot mapping, read through block tables.

One step mixes decode tokens (one query each) and prefill chunks (many queries, possibly
after a cached prefix). On CPU, tokenmill's kernels attend both over the blocks where they
lie (``paged_decode_attention``, ``paged_prefill_attention``). Otherwise each group is one
batched ``scaled_dot_product_attention`` call over K/V gathered from the block tables; grouped-query attention folds the query heads of a KV
head into extra query rows, so K/V are never repeated. Per-step data arrives as an explicit
``AttentionMetadata`` built once per step by ``TorchSDPABackend`` (``attention_backend.py``),
the backend object the model calls; these are its kernels.

An fp8 cache stores K/V divided by a per-layer, per-tensor scale (``kv_scales`` = [k, v]) and
read back multiplied by it; torch has no fp8 index kernels on CPU, so fp8 caches are
written and gathered as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.model.opaque_op import opaque_op, register_fake


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
    segments: list[tuple[int, int, int]] | None = None
    """Per request (first row, queries, context length) where its rows are consecutive and
    its queries are the last positions of its context (every prefill chunk); else None."""
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """Per sliding window (None = full): [B, 1, max_q, max_kv] bool, True = attend."""
    _split: tuple[list[tuple[int, int, int]], AttentionGroup | None] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _chunks: tuple[torch.Tensor, slice | torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def chunk_rows(self) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """For the paged prefill kernel: (query_start [B + 1], the group's token rows in
        request order: a slice where they are consecutive, else an index); built once per
        step. Needs ``segments``."""
        if self._chunks is None:
            assert self.segments is not None
            starts = [0]
            for _, n, _ in self.segments:
                starts.append(starts[-1] + n)
            first = self.segments[0][0]
            consecutive = all(
                seg[0] == first + start for seg, start in zip(self.segments, starts, strict=False)
            )
            rows: slice | torch.Tensor = (
                slice(first, first + starts[-1])
                if consecutive
                else torch.tensor(
                    [r for f, n, _ in self.segments for r in range(f, f + n)],
                    device=self.token_index.device,
                )
            )
            self._chunks = (torch.tensor(starts, device=self.token_index.device), rows)
        return self._chunks

    def split_fresh(self) -> tuple[list[tuple[int, int, int]], AttentionGroup | None]:
        """(index, first row, tokens) of each request with no cached prefix, and the other
        requests as a group of their own (None if there are none); built once per step."""
        if self._split is None:
            segments = self.segments or []
            fresh = [(i, first, n) for i, (first, n, ctx) in enumerate(segments) if n == ctx]
            rest_idx = [i for i, (_, n, ctx) in enumerate(segments) if n != ctx]
            rest = None
            if rest_idx:
                pick = torch.tensor(rest_idx, device=self.token_index.device)
                rest = AttentionGroup(
                    token_index=self.token_index[pick],
                    valid=self.valid[pick],
                    block_tables=self.block_tables[pick],
                    query_positions=self.query_positions[pick],
                    context_lens=self.context_lens[pick],
                    is_decode=self.is_decode,
                )
            self._split = (fresh, rest)
        return self._split

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            max_kv = self.block_tables.shape[1] * block_size
            self.masks[window] = attention_mask(
                self.query_positions, self.context_lens, max_kv, window
            )
        return self.masks[window]


def attention_mask(
    query_positions: torch.Tensor, context_lens: torch.Tensor, max_kv: int, window: int | None
) -> torch.Tensor:
    """[B, 1, max_q, max_kv] bool: causal, within the context, and within the sliding window."""
    kv_pos = torch.arange(max_kv, device=context_lens.device)[None, None, :]
    q_pos = query_positions[:, :, None]
    allowed = (kv_pos <= q_pos) & (kv_pos < context_lens[:, None, None])
    if window is not None:
        allowed &= kv_pos > q_pos - window
    return allowed.unsqueeze(1)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once per step by the runner."""

    slot_mapping: torch.Tensor
    """[T] flat KV slot (block_id * block_size + offset) for each token's K/V."""
    groups: list[AttentionGroup]
    num_tokens: int


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` in the cache's storage: the same dtype, or scaled, saturated fp8 as bytes."""
    if cache.dtype not in FP8_DTYPES:
        return x.to(cache.dtype)
    limit = torch.finfo(cache.dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache.dtype).view(torch.uint8)


def _storage(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store this step's K/V [T, Hkv, D] into caches shaped [num_blocks, block_size, Hkv, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_cache.dtype not in FP8_DTYPES:  # the per-step path: no scales to index
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    scales = kv_scales if kv_scales is not None else k.new_ones(2, dtype=torch.float32)
    _storage(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(
        0, slots, _to_cache(k, k_cache, scales[0])
    )
    _storage(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(
        0, slots, _to_cache(v, v_cache, scales[1])
    )


def _gather(
    cache: torch.Tensor, flat_tables: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks ``flat_tables`` of a cache, in the compute dtype."""
    if cache.dtype not in FP8_DTYPES:
        return cache.index_select(0, flat_tables).to(dtype)
    raw = cache.view(torch.uint8).index_select(0, flat_tables).view(cache.dtype)
    return (raw.to(torch.float32) * scale).to(dtype)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, max_q, Hq, D] over K/V gathered through block_tables; mask [B, 1, max_q, L].

    ``softcap`` > 0 caps the scores as ``softcap * tanh(scores / softcap)`` (Gemma 2), which
    SDPA cannot do, so those layers compute the softmax explicitly (in fp32, as transformers).
    """
    batch, max_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    # K/V: [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]. index_select, not
    # advanced indexing: 3.5x faster for this gather on CPU (0.44 vs 1.54 ms at batch 32).
    flat_tables = block_tables.reshape(-1)
    scales = kv_scales if kv_scales is not None else q.new_ones(2, dtype=torch.float32)
    keys = (
        _gather(k_cache, flat_tables, scales[0], q.dtype)
        .view(batch, -1, num_kv_heads, head_dim)
        .transpose(1, 2)
    )
    values = (
        _gather(v_cache, flat_tables, scales[1], q.dtype)
        .view(batch, -1, num_kv_heads, head_dim)
        .transpose(1, 2)
    )
    # Queries: [B, max_q, Hkv, G, D] -> [B, Hkv, G * max_q, D]
    qg = q.view(batch, max_q, num_kv_heads, group_size, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group_size * max_q, head_dim)
    if max_q > 1:
        mask = (
            mask.unsqueeze(2)
            .expand(-1, -1, group_size, -1, -1)
            .reshape(batch, 1, group_size * max_q, -1)
        )
    if softcap > 0:
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attn = torch.matmul(weights, values)
    else:
        attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    attn = attn.view(batch, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return attn.reshape(batch * max_q, num_heads * head_dim)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: (out [1, H, n, D], log-sum-exp [1, H, n] fp32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse


def _causal_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of one request's whole prompt q [n, Hq, D] (no cached prefix) over
    its own K/V in ``blocks``; returns [n, Hq * D].

    torch's flash kernel with ``is_causal`` skips the masked upper triangle, which the
    explicit-mask path cannot (it also builds and reads a [G * n, context] mask): 1.2-1.8x
    less CPU time per layer for 32-1024-token prompts (benchmarks/kernels.py,
    ``prefill_attention_ms_per_layer``). After a cached prefix the mask path stays: two
    flash calls merged by log-sum-exp measured slower than it.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads

    def heads(cache: torch.Tensor, scale_: torch.Tensor) -> torch.Tensor:
        """[1, Hq, n, D], contiguous: the flash kernel wants one K/V head per query head."""
        x = _gather(cache, blocks, scale_, q.dtype).view(-1, num_kv_heads, head_dim)[:n]
        return x.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)

    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    out, _ = _flash(qh, heads(k_cache, kv_scales[0]), heads(v_cache, kv_scales[1]), True, scale)
    return out[0].transpose(0, 1).reshape(n, num_heads * head_dim)


def _causal_prefill_applies(
    q: torch.Tensor, group: AttentionGroup, window: int | None, softcap: float
) -> bool:
    """Whether a chunk group's fresh prompts can take ``_causal_prefill``: CPU, no softcap,
    and no sliding window shorter than a context (those need the explicit mask)."""
    if group.is_decode or group.segments is None or softcap > 0 or q.device.type != "cpu":
        return False
    return window is None or all(ctx <= window for _, _, ctx in group.segments)


_KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16, *FP8_DTYPES)


def _decode_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether tokenmill's paged decode kernel takes these queries and this cache."""
    return kernels.supports(q, float32=True) and k_cache.dtype in _KERNEL_KV_DTYPES


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scales(device: torch.device) -> torch.Tensor:
    """[k_scale, v_scale] = [1, 1] for caches that are not fp8, made once per device (not
    once per layer and step)."""
    scales = _UNIT_SCALES.get(device)
    if scales is None:
        scales = _UNIT_SCALES[device] = torch.ones(2, dtype=torch.float32, device=device)
    return scales


def _decode_rows(group: AttentionGroup) -> slice | torch.Tensor:
    """The decode group's rows of the token batch: a slice where they are consecutive
    (``AttentionGroup.chunk_rows``, once per step), else the index."""
    if group.segments is not None:
        return group.chunk_rows()[1]
    return group.token_index.view(-1)


def decode_only_group(meta: object, num_tokens: int) -> AttentionGroup | None:
    """The step's one decode group when every row of it decodes, in order, on tokenmill's
    kernel (what ``paged_attention`` attends without a gather), else None."""
    if not isinstance(meta, AttentionMetadata) or len(meta.groups) != 1:
        return None
    group = meta.groups[0]
    if not group.is_decode or _decode_rows(group) != slice(0, num_tokens):
        return None
    return group


def _decode_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    kv_scales: torch.Tensor | None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """tokenmill CPU kernel: one query per row [B, Hq, D] over the blocks where they lie."""
    scales = kv_scales if kv_scales is not None else _unit_scales(q.device)
    return kernels.paged_decode_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        window or 0,
        scales,
        softcap,
    )


PREFILL_KERNEL = True
"""Whether prompt chunks (fresh or after a cached prefix) take tokenmill's paged prefill
kernel where it applies; off: the torch paths (gather + SDPA). For A/B benchmarks."""


def _prefill_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
    kv_scales: torch.Tensor | None,
    softcap: float,
) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """tokenmill CPU kernel: every chunk of the group over its blocks where they lie;
    returns (the rows of q it attended, their outputs [rows, Hq * D])."""
    query_start, rows = group.chunk_rows()
    scales = kv_scales if kv_scales is not None else q.new_ones(2, dtype=torch.float32)
    out = kernels.paged_prefill_attention(
        q[rows].contiguous(),
        k_cache,
        v_cache,
        group.block_tables,
        group.context_lens,
        query_start,
        scale,
        window or 0,
        scales,
        softcap,
    )
    return rows, out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    kv_scales: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of queries q [T, Hq, D] over the cached K/V; returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    groups = list(meta.groups)

    def decode(group: AttentionGroup, rows: slice | torch.Tensor) -> torch.Tensor:
        """tokenmill's CPU decode kernel over the group's rows of q."""
        return _decode_kernel(
            q[rows],
            k_cache,
            v_cache,
            group.block_tables,
            group.context_lens,
            scale,
            window,
            kv_scales,
            softcap,
        )

    only = decode_only_group(meta, num_tokens)
    if only is not None and _decode_kernel_applies(q, k_cache):
        # The kernel's output is the step's: no gather of q, no scatter into out (one
        # stream pays those per layer as much as a short context's attention itself).
        return decode(only, slice(0, num_tokens))
    out = q.new_empty(num_tokens, num_heads * head_dim)
    while groups:
        group = groups.pop(0)
        if group.is_decode and _decode_kernel_applies(q, k_cache):  # tokenmill CPU kernel
            rows = _decode_rows(group)
            out[rows] = decode(group, rows)
            continue
        if (
            PREFILL_KERNEL
            and not group.is_decode
            and group.segments is not None
            and _decode_kernel_applies(q, k_cache)
        ):
            chunk_rows, attn = _prefill_kernel(
                q, k_cache, v_cache, group, scale, window, kv_scales, softcap
            )
            if isinstance(chunk_rows, slice) and chunk_rows == slice(0, num_tokens):
                # One group holds every row (a prompt step): the kernel's output is the
                # step's, not copied into out (a 1,024-token step: 2 MiB a layer).
                return attn
            out[chunk_rows] = attn
            continue
        if _causal_prefill_applies(q, group, window, softcap):
            scales = kv_scales if kv_scales is not None else q.new_ones(2, dtype=torch.float32)
            fresh, rest = group.split_fresh()
            for i, first, n in fresh:
                blocks = group.block_tables[i, : -(-n // block_size)]
                out[first : first + n] = _causal_prefill(
                    q[first : first + n], k_cache, v_cache, blocks, scale, scales
                )
            if rest is not None:
                groups.insert(0, rest)  # chunks after a cached prefix: the mask path
            continue
        rows = q[group.token_index]
        attn = _attend(
            rows,
            k_cache,
            v_cache,
            group.block_tables,
            group.mask(window, block_size),
            scale,
            kv_scales,
            softcap,
        )
        if group.is_decode:
            out[group.token_index.view(-1)] = attn
        else:
            valid = group.valid.view(-1)
            out[group.token_index.view(-1)[valid]] = attn[valid]
    return out


@dataclass
class DecodeMetadata:
    """A decode-only step with fixed shapes (the compiled / graph-captured path).

    Row i is one request's single new token; padding rows point at a scratch block.
    """

    slot_mapping: torch.Tensor
    """[B] KV slot of each row's token."""
    block_tables: torch.Tensor
    """[B, max_blocks_per_seq] block ids, fixed width."""
    context_lens: torch.Tensor
    """[B] tokens with KV after this step's write (>= 1)."""
    trim_to_longest: bool = True
    """Gather only up to the longest context (data-dependent: off under CUDA graphs)."""


@opaque_op("decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    trim_to_longest: bool,
    kv_scales: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write this step's K/V and attend, one query per row; opaque to torch.compile.

    Being one op with declared mutations lets inductor compile everything around it
    (norms, RoPE, SwiGLU) without copying the cache, and keeps the data-dependent trim
    out of the traced graph. ``window`` 0 means full attention, ``softcap`` 0 no capping.
    """
    write_kv(k_cache, v_cache, k, v, slot_mapping, kv_scales)
    if _decode_kernel_applies(q, k_cache):  # tokenmill CPU kernel: no gather, no trim needed
        return _decode_kernel(
            q, k_cache, v_cache, block_tables, context_lens, scale, window, kv_scales, softcap
        )
    block_size = k_cache.shape[1]
    if trim_to_longest:
        block_tables = block_tables[:, : -(-int(context_lens.max()) // block_size)]
    mask = attention_mask(
        (context_lens - 1)[:, None],
        context_lens,
        block_tables.shape[1] * block_size,
        window or None,
    )
    return _attend(q.unsqueeze(1), k_cache, v_cache, block_tables, mask, scale, kv_scales, softcap)


@register_fake("decode_attention")
def _decode_attention_fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    context_lens,
    scale,
    window,
    trim_to_longest,
    kv_scales,
    softcap=0.0,
):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
