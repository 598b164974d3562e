"""The kernels are custom ops with fake implementations: torch.compile traces them in one
graph (as ``static``'s compiled decode step does) and the compiled result equals eager."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels import amx_layout


def _step(x, residual, norm_w, gate_up_w, positions, cos, sin, k_cache, v_cache, tables, lens):
    h, residual = kernels.rms_norm(x, norm_w, 1e-6, residual)
    h = kernels.silu_and_mul(h.repeat(1, 2))
    q = h.view(-1, 4, 16)
    q, k = kernels.rope(positions, q, q[:, :2].contiguous(), cos, sin)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 0, torch.ones(2))
    return kernels.linear_bf16(out, gate_up_w, None), residual, k


def test_every_op_traces_in_one_graph_and_matches_eager() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    args = (
        rnd(3, 64),
        rnd(3, 64),
        rnd(64),
        rnd(32, 64),
        torch.tensor([0, 5, 9]),
        torch.randn(16, 16, generator=gen),
        torch.randn(16, 16, generator=gen),
        rnd(6, 4, 2, 16),
        rnd(6, 4, 2, 16),
        torch.tensor([[0, 1], [2, 3], [4, 5]]),
        torch.tensor([1, 5, 8]),
    )
    compiled = torch.compile(_step, fullgraph=True)
    for got, want in zip(compiled(*args), _step(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_the_amx_ops_trace_too() -> None:
    if not kernels.amx_active():
        pytest.skip("AMX tiles are not granted (or are switched off) in this process")
    torch._dynamo.reset()
    q = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    tiles = amx_layout.pack_int8(q)
    scales = amx_layout.block_channels(torch.rand(40))
    sums = amx_layout.block_channels(q.int().sum(1, dtype=torch.int32))

    def fn(x):
        return kernels.linear_int8_amx(x, tiles, scales, sums, None, 40) * 2

    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x))


def test_the_vnni_tile_ops_trace_too() -> None:
    if not kernels.active_isa().startswith("avx512_bf16"):
        pytest.skip("the VNNI tile ops need the avx512 table")
    torch._dynamo.reset()
    q = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    codes = torch.randint(0, 16, (40, 128))
    block = amx_layout.block_channels
    scales, sums = block(torch.rand(40)), block(q.int().sum(1, dtype=torch.int32))
    g_scales, g_offsets = block(torch.rand(40, 1) * 0.02), block(torch.randn(40, 1) * 0.1)
    g_sums = block(codes.sum(1, keepdim=True, dtype=torch.int32))
    tiles8, tiles4 = amx_layout.pack_int8(q), amx_layout.pack_int4(codes)

    def fn(x):
        y = kernels.linear_int8_vnni(x, tiles8, scales, sums, None, 40)
        y = torch.cat((y, y, y[:, :48]), dim=1)  # 128 wide: the int4 layer's input
        return kernels.linear_int4_vnni(y, tiles4, g_scales, g_sums, g_offsets, 128, None, 40) * 2

    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x))


def _rope_write_attend(q, k, v, positions, cos, sin, k_cache, v_cache, slots, tables, lens):
    q = kernels.rope_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slots, torch.ones(2))
    return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 0, torch.ones(2))


def test_fused_rope_kv_write_traces_and_writes_the_callers_caches_in_place() -> None:
    """As in ``static``'s compiled step: the op's declared mutations reach the caller's
    caches, attention after it sees the new K/V, and inductor does not copy the caches."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    q, k, v = rnd(3, 4, 16), rnd(3, 2, 16), rnd(3, 2, 16)
    caches = [rnd(6, 4, 2, 16), rnd(6, 4, 2, 16)]
    rest = (
        torch.tensor([0, 5, 9]),
        torch.randn(16, 16, generator=gen),
        torch.randn(16, 16, generator=gen),
    )
    meta = (
        torch.tensor([0, 9, 21]),
        torch.tensor([[0, 1], [2, 3], [4, 5]]),
        torch.tensor([1, 6, 8]),
    )
    eager = [c.clone() for c in caches]
    want = _rope_write_attend(q, k, v, *rest, *eager, *meta)
    compiled = torch.compile(_rope_write_attend, fullgraph=True)
    got, (code,) = run_and_get_code(compiled, q, k, v, *rest, *caches, *meta)
    torch.testing.assert_close(got, want)
    for a, b in zip(caches, eager, strict=True):
        assert torch.equal(a, b)
    assert "clone" not in code and "copy_" not in code, code


def test_paged_prefill_attention_traces_and_matches_eager() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 16, generator=gen).bfloat16()
    k_cache, v_cache = (torch.randn(6, 4, 2, 16, generator=gen).bfloat16() for _ in range(2))
    tables, lens, starts = (
        torch.tensor([[0, 1], [2, 3]]),
        torch.tensor([5, 6]),
        torch.tensor([0, 5, 7]),
    )

    def fn(q):
        out = kernels.paged_prefill_attention(
            q, k_cache, v_cache, tables, lens, starts, 0.25, 0, torch.ones(2)
        )
        return out * 2

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q), fn(q))
