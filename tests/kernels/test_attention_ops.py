"""The paged attention kernels (decode and prefill chunks) against a torch reference: every
KV dtype, GQA groups, sliding windows, softcaps, split long contexts, both ISAs, one and two
threads."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import DTYPES, KV_DTYPES, generator, randn, tol
from tokenmill import kernels


def _reference_attention(q, k_cache, v_cache, tables, lens, scale, window, kv_scales, softcap=0.0):
    out = []
    for b in range(q.shape[0]):
        ctx = int(lens[b])
        slots = torch.arange(ctx)
        blocks = tables[b][slots // k_cache.shape[1]]
        keys = k_cache[blocks, slots % k_cache.shape[1]].float() * kv_scales[0]
        values = v_cache[blocks, slots % k_cache.shape[1]].float() * kv_scales[1]
        start = max(0, ctx - window) if window else 0
        keys, values = keys[start:], values[start:]
        group = q.shape[1] // k_cache.shape[2]
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "dim", "block_size", "window"),
    [
        (4, 2, 16, 16, 0),
        (16, 4, 64, 16, 0),
        (3, 3, 40, 8, 0),
        (12, 1, 24, 4, 5),
        (16, 2, 80, 16, 0),  # G = 8, head_dim not a multiple of 32
        (8, 8, 128, 16, 3),  # G = 1
        (9, 3, 64, 16, 0),  # G = 3 (SmolLM2): the keys scored in place, a lane idle
        (4, 1, 256, 16, 0),  # one KV head, head_dim 256 (Gemma 3)
    ],
)
def test_paged_decode_attention(isa, threads, kv_dtype, q_dtype, hq, hkv, dim, block_size, window):
    lens = torch.tensor([1, 9, 37])
    num_blocks = 40
    gen = generator(7)
    # Blocks scattered over the pool, in no order: the kernel reads them where they lie.
    order = torch.randperm(num_blocks, generator=gen)
    width = -(-int(lens.max()) // block_size)
    tables = order[: 3 * width].view(3, width)
    kv_scales = torch.tensor([0.5, 2.0]) if kv_dtype.itemsize == 1 else torch.ones(2)
    k_cache = (randn(num_blocks, block_size, hkv, dim, seed=1) / kv_scales[0]).to(kv_dtype)
    v_cache = (randn(num_blocks, block_size, hkv, dim, seed=2) / kv_scales[1]).to(kv_dtype)
    q = randn(3, hq, dim, dtype=q_dtype, seed=3)
    scale = dim**-0.5
    want = _reference_attention(q, k_cache, v_cache, tables, lens, scale, window, kv_scales)
    got = kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, window, kv_scales
    )
    assert got.dtype == q_dtype and got.shape == (3, hq * dim)
    torch.testing.assert_close(got.float(), want, **tol(q_dtype))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize(
    ("lengths", "window", "softcap"),
    [
        ([1037], 0, 0.0),
        ([600], 0, 0.0),  # two splits: with 2 threads, one KV head per item, then merged
        ([200], 0, 0.0),  # short, but its 2 KV heads are 1 item per thread: split in two
        ([333], 0, 5.0),
        ([300], 150, 0.0),  # the window leaves 150 keys: still split in two
        ([1037, 600], 700, 0.0),
        ([1037, 600, 5], 0, 5.0),
    ],
)
def test_paged_decode_attention_long_contexts_split(
    isa, threads, kv_dtype, lengths, window, softcap
):
    """Long contexts with few sequences are split across items (whole blocks, merged by
    log-sum-exp), and so are short ones whose KV heads are fewer than 2 per thread; Gemma 2's
    softcap is applied before the softmax; lengths end mid-block."""
    hq, hkv, dim, block_size = 8, 2, 64, 16
    lens = torch.tensor(lengths)
    batch = len(lengths)
    width = -(-int(lens.max()) // block_size)
    num_blocks = batch * width + 3
    tables = torch.randperm(num_blocks, generator=generator(4))[: batch * width].view(batch, width)
    kv_scales = torch.tensor([0.5, 2.0]) if kv_dtype.itemsize == 1 else torch.ones(2)
    k_cache = (randn(num_blocks, block_size, hkv, dim, seed=1) * 2 / kv_scales[0]).to(kv_dtype)
    v_cache = (randn(num_blocks, block_size, hkv, dim, seed=2) / kv_scales[1]).to(kv_dtype)
    q = randn(batch, hq, dim, dtype=torch.bfloat16, seed=3)
    want = _reference_attention(
        q, k_cache, v_cache, tables, lens, 0.125, window, kv_scales, softcap
    )
    got = kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.125, window, kv_scales, softcap
    )
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))


def test_paged_decode_attention_softcap_fp32(isa) -> None:
    """fp32 with a cap: as close to the reference as fp32 allows (Gemma 2 parity runs it)."""
    lens = torch.tensor([3, 40])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    k_cache, v_cache = randn(6, 16, 2, 32, seed=1) * 3, randn(6, 16, 2, 32, seed=2)
    q = randn(2, 4, 32, seed=3) * 3
    want = _reference_attention(q, k_cache, v_cache, tables, lens, 0.2, 0, torch.ones(2), 2.0)
    got = kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.2, 0, torch.ones(2), 2.0
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _reference_prefill(
    q, k_cache, v_cache, tables, lens, starts, scale, window, kv_scales, softcap
):
    """Each sequence's queries (its last positions) causally over its cached tokens, fp32."""
    out, block = [], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for b, ctx in enumerate(lens.tolist()):
        rows = q[int(starts[b]) : int(starts[b + 1])].float()
        slots = torch.arange(ctx)
        blocks = tables[b][slots // block]
        keys = (k_cache[blocks, slots % block].float() * kv_scales[0]).repeat_interleave(group, 1)
        values = (v_cache[blocks, slots % block].float() * kv_scales[1]).repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", rows, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - rows.shape[0], ctx)[:, None]
        allowed = slots[None, :] <= q_pos
        if window:
            allowed &= slots[None, :] > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values).flatten(1))
    return torch.cat(out)


def _prefill_case(kv_dtype, q_dtype, hq, hkv, dim, block_size, chunks, seed=0):
    """Caches with blocks scattered over the pool; chunks: (cached prefix, new tokens) each."""
    lens = torch.tensor([p + n for p, n in chunks])
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(chunks) * width + 2
    tables = torch.randperm(num_blocks, generator=generator(seed))[: len(chunks) * width]
    kv_scales = torch.tensor([0.5, 2.0]) if kv_dtype.itemsize == 1 else torch.ones(2)
    k_cache = (randn(num_blocks, block_size, hkv, dim, seed=1) / kv_scales[0]).to(kv_dtype)
    v_cache = (randn(num_blocks, block_size, hkv, dim, seed=2) / kv_scales[1]).to(kv_dtype)
    q = randn(int(starts[-1]), hq, dim, dtype=q_dtype, seed=3)
    return q, k_cache, v_cache, tables.view(len(chunks), width), lens, starts, kv_scales


PREFILL_CHUNKS = [(0, 37), (20, 13), (64, 1), (5, 70), (450, 140)]
"""A fresh prompt, a chunk after a cached prefix, a single query at the end of a long context,
a chunk longer than the AVX2 kernels' query tiles, and a context over two key tiles (256 keys,
512 on AMX: the online softmax rescales across them) whose chunk spans two AMX work items; no
length a multiple of a block."""


PREFILL_HEADS = [
    (16, 4, 64, 16, 0, 0.0),  # G = 4, the benchmark Llama's heads
    (8, 8, 128, 16, 0, 0.0),  # G = 1
    (8, 4, 80, 8, 0, 0.0),  # G = 2, head_dim not a multiple of 32
    (16, 2, 64, 5, 23, 0.0),  # G = 8, sliding window, odd block size
    (6, 2, 24, 4, 0, 5.0),  # G = 3, softcap
    (4, 1, 256, 16, 0, 0.0),  # G = 4, Gemma 3's head_dim
]
"""(hq, hkv, dim, block_size, window, softcap) of the prefill cases."""


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "dim", "block_size", "window", "softcap"), PREFILL_HEADS)
def test_paged_prefill_attention(
    isa, threads, kv_dtype, q_dtype, hq, hkv, dim, block_size, window, softcap
):
    q, k_cache, v_cache, tables, lens, starts, kv_scales = _prefill_case(
        kv_dtype, q_dtype, hq, hkv, dim, block_size, PREFILL_CHUNKS
    )
    scale = dim**-0.5
    want = _reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, scale, window, kv_scales, softcap
    )
    got = kernels.paged_prefill_attention(
        q, k_cache, v_cache, tables, lens, starts, scale, window, kv_scales, softcap
    )
    assert got.dtype == q_dtype and got.shape == (q.shape[0], hq * dim)
    torch.testing.assert_close(got.float(), want, **tol(q_dtype))


@pytest.mark.parametrize(("hq", "hkv", "dim", "block_size", "window", "softcap"), PREFILL_HEADS)
def test_paged_prefill_attention_on_amx_tiles(threads, hq, hkv, dim, block_size, window, softcap):
    """bf16 queries over a bf16 cache run Q.K and P.V on AMX-BF16 tiles where granted: every
    head size (tails of 16 channels, 256), the tails of a key tile and of a query tile, windows
    and softcaps, against the reference and within rounding of the AVX-512 dot products."""
    if not kernels.amx_bf16_active():
        pytest.skip("AMX-BF16 tiles are not granted (or are switched off) in this process")
    args = _prefill_case(
        torch.bfloat16, torch.bfloat16, hq, hkv, dim, block_size, PREFILL_CHUNKS + [(3, 150)]
    )
    q, k_cache, v_cache, tables, lens, starts, kv_scales = args
    scale = dim**-0.5
    want = _reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, scale, window, kv_scales, softcap
    )
    call = (q, k_cache, v_cache, tables, lens, starts, scale, window, kv_scales, softcap)
    got = kernels.paged_prefill_attention(*call)
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))
    kernels.set_isa("avx512")
    try:
        dots = kernels.paged_prefill_attention(*call)
    finally:
        kernels.set_isa("auto")
    torch.testing.assert_close(got.float(), dots.float(), **tol(torch.bfloat16))


def test_paged_prefill_attention_matches_decode_for_single_queries(isa) -> None:
    """One query per sequence is a decode step: both kernels agree (bf16 cache)."""
    chunks = [(40, 1), (0, 1), (99, 1)]
    q, k_cache, v_cache, tables, lens, starts, kv_scales = _prefill_case(
        torch.bfloat16, torch.bfloat16, 8, 2, 64, 16, chunks
    )
    got = kernels.paged_prefill_attention(
        q, k_cache, v_cache, tables, lens, starts, 0.125, 0, kv_scales
    )
    want = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 0, kv_scales)
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.bfloat16))


def test_paged_prefill_attention_rejects_bad_ranges() -> None:
    q, k_cache, v_cache, tables, lens, starts, kv_scales = _prefill_case(
        torch.bfloat16, torch.bfloat16, 4, 2, 16, 4, [(0, 5), (3, 2)]
    )
    with pytest.raises(RuntimeError, match="queries for a context"):
        kernels.paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([4, 5]), starts, 0.25, 0, kv_scales
        )
    with pytest.raises(RuntimeError, match="query_start"):
        kernels.paged_prefill_attention(
            q, k_cache, v_cache, tables, lens, starts + 1, 0.25, 0, kv_scales
        )
