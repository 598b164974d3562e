"""Prefill-chunk attention: the causal flash path (with a cached prefix merged by
log-sum-exp) against the explicit-mask path and a plain softmax reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.model import attention
from tokenmill.model.attention_backend import BatchGroup, StepBatch, TorchSDPABackend

BLOCK = 4


def _step(chunks: list[tuple[int, int]], num_blocks: int) -> BatchGroup:
    """One chunk group: per request (cached prefix, new tokens), blocks handed out in a
    shuffled order so tables point all over the pool."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    rows, pos, tables, lens, first, used = [], [], [], [], 0, 0
    for prefix, n in chunks:
        ctx = prefix + n
        nb = -(-ctx // BLOCK)
        rows.append(list(range(first, first + n)))
        pos.append(list(range(prefix, ctx)))
        tables.append(order[used : used + nb])
        lens.append(ctx)
        first, used = first + n, used + nb
    return BatchGroup(False, rows, pos, tables, lens)


def _reference(q, k_cache, v_cache, group: BatchGroup, scale, window, kv_scales):
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    rep = q.shape[1] // k_cache.shape[2]
    for rows, pos, table, ctx in zip(
        group.token_index,
        group.query_positions,
        group.block_tables,
        group.context_lens,
        strict=True,
    ):
        slots = torch.arange(ctx)
        blocks = torch.tensor(table)[slots // BLOCK]
        keys = k_cache[blocks, slots % BLOCK].float() * kv_scales[0]
        values = v_cache[blocks, slots % BLOCK].float() * kv_scales[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        qp, kp = torch.tensor(pos)[:, None], slots[None, :]
        allowed = kp <= qp
        if window:
            allowed &= kp > qp - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).flatten(1)
    return out


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("window", [None, 64, 7])
@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_chunk_attention_matches_reference(
    dtype, kv_dtype, window, prefill_kernel, monkeypatch
) -> None:
    """With the paged prefill kernel (where the CPU kernels are built) and with torch's paths."""
    monkeypatch.setattr(attention, "PREFILL_KERNEL", prefill_kernel)
    hq, hkv, dim, num_blocks = 6, 2, 16, 40
    chunks = [(0, 9), (13, 5), (6, 1), (0, 1), (21, 30)]  # prefill, chunk after a prefix, ...
    batch = _step(chunks, num_blocks)
    gen = torch.Generator().manual_seed(0)
    total = sum(n for _, n in chunks)
    q = torch.randn(total, hq, dim, generator=gen).to(dtype)
    kv_scales = torch.tensor([0.5, 2.0]) if kv_dtype.itemsize == 1 else torch.ones(2)
    k_cache = (torch.randn(num_blocks, BLOCK, hkv, dim, generator=gen) / kv_scales[0]).to(kv_dtype)
    v_cache = (torch.randn(num_blocks, BLOCK, hkv, dim, generator=gen) / kv_scales[1]).to(kv_dtype)
    backend = TorchSDPABackend(torch.device("cpu"))
    meta = backend.build_metadata(StepBatch([0] * total, [batch], total))
    assert meta.groups[0].segments is not None
    masked = dataclasses.replace(meta, groups=[dataclasses.replace(meta.groups[0], segments=None)])
    scale = dim**-0.5
    got = attention.paged_attention(q, k_cache, v_cache, meta, scale, window, kv_scales)
    via_mask = attention.paged_attention(q, k_cache, v_cache, masked, scale, window, kv_scales)
    want = _reference(q, k_cache, v_cache, batch, scale, window, kv_scales)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(via_mask.float(), want, **tol)


def test_segments_need_consecutive_rows_ending_at_the_context() -> None:
    backend = TorchSDPABackend(torch.device("cpu"))
    good = BatchGroup(False, [[0, 1, 2], [3]], [[5, 6, 7], [0]], [[0, 1], [2]], [8, 1])
    gap = BatchGroup(False, [[0, 2]], [[0, 1]], [[0]], [2])
    early = BatchGroup(False, [[0, 1]], [[0, 1]], [[0]], [3])
    assert backend.build_metadata(StepBatch([0] * 4, [good], 4)).groups[0].segments == [
        (0, 3, 8),
        (3, 1, 1),
    ]
    for group in (gap, early):
        assert backend.build_metadata(StepBatch([0] * 3, [group], 3)).groups[0].segments is None


class _Layer:
    """The attention-layer state a backend reads (decoder.Attention has the same fields)."""

    def __init__(self, calibrated: bool) -> None:
        self.layer_idx, self.scale, self.window, self.logit_softcap = 0, 0.25, None, None
        self.kv_scales = torch.tensor([0.02, 0.03]) if calibrated else torch.ones(2)
        self.kv_scales_calibrated = calibrated

    def calibrate_kv_scales(self, k, v, dtype) -> None:
        self.kv_scales = torch.tensor([0.05, 0.07])
        self.kv_scales_calibrated = True


@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("calibrated", [True, False])
def test_fused_rope_and_kv_write_match_rope_then_forward(kv_dtype, calibrated) -> None:
    """The backend's fused RoPE + KV write (CPU kernels, bf16) leaves the same caches and
    attention output as rotating first and calling ``forward``; an fp8 cache that is not
    calibrated yet takes the unfused path, which calibrates it from the rotated K."""
    from tokenmill import kernels
    from tokenmill.model.attention_backend import AttentionBackend
    from tokenmill.model.layers import RotaryEmbedding

    if not kernels.available():
        pytest.skip("the tokenmill CPU kernels could not be built here")
    hq, hkv, dim, num_blocks = 6, 2, 16, 40
    chunks = [(0, 9), (13, 5), (6, 1), (21, 30)]
    batch = _step(chunks, num_blocks)
    total = sum(n for _, n in chunks)
    slots = [
        table[p // BLOCK] * BLOCK + p % BLOCK
        for table, pos in zip(batch.block_tables, batch.query_positions, strict=True)
        for p in pos
    ]
    backend = TorchSDPABackend(torch.device("cpu"))
    meta = backend.build_metadata(StepBatch(slots, [batch], total))
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(total, (hq + 2 * hkv) * dim, generator=gen).bfloat16()
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k, v = q.view(total, hq, dim), k.view(total, hkv, dim), v.view(total, hkv, dim)
    positions = torch.tensor([p for pos in batch.query_positions for p in pos])
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    caches = {
        name: tuple(
            torch.randn(num_blocks, BLOCK, hkv, dim, generator=gen).to(kv_dtype) for _ in (0, 1)
        )
        for name in ("fused",)
    }
    caches["plain"] = tuple(c.clone() for c in caches["fused"])
    layers = {name: _Layer(calibrated) for name in caches}
    got = backend.forward_rope(layers["fused"], positions, rope, q, k, v, caches["fused"], meta)
    want = AttentionBackend.forward_rope(
        backend, layers["plain"], positions, rope, q, k, v, caches["plain"], meta
    )
    assert torch.equal(got, want)
    for a, b in zip(caches["fused"], caches["plain"], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(layers["fused"].kv_scales, layers["plain"].kv_scales)
