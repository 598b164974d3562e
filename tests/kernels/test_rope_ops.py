"""RoPE's C++ ops against torch: alone, fused with the paged KV-cache write, and from a qkv
projection's rows with the q/k norms (the decode step's prologue); both ISAs, one and two
threads, every cache dtype the fused write takes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import DTYPES, KV_DTYPES, generator, randn, tol
from tokenmill import kernels
from tokenmill.model.layers import RotaryEmbedding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "dim"), [(1, 4, 2, 16), (7, 3, 1, 64), (33, 16, 4, 40)]
)
def test_rope(isa, threads, dtype, tokens: int, hq: int, hk: int, dim: int) -> None:
    rope = RotaryEmbedding(dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,), generator=generator(3))
    qkv = randn(tokens, (hq + 2 * hk) * dim, dtype=dtype)
    q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k = q.reshape(tokens, hq, dim), k.reshape(tokens, hk, dim)  # views with a token stride
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = kernels.rope(positions, q, k, rope.cos, rope.sin)
    torch.testing.assert_close(got_q, want_q, **tol(dtype))
    torch.testing.assert_close(got_k, want_k, **tol(dtype))


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, *KV_DTYPES[2:]]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "dim", "block_size"),
    [(1, 4, 2, 16, 16), (7, 3, 1, 64, 4), (33, 16, 4, 40, 8)],
)
def test_rope_kv_write(isa, threads, cache_dtype, dtype, tokens, hq, hk, dim, block_size) -> None:
    """The fused op equals RoPE then ``write_kv`` bit for bit: same rotated q, and the caches
    hold the same bytes, the untouched slots included."""
    from tokenmill.model.attention import write_kv

    rope = RotaryEmbedding(dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,), generator=generator(3))
    qkv = randn(tokens, (hq + 2 * hk) * dim, dtype=dtype)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)  # views with a token stride
    q, k, v = (x.reshape(tokens, -1, dim) for x in (q, k, v))
    num_blocks = -(-2 * tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=generator(4))[:tokens]  # scattered
    kv_scales = torch.tensor([0.02, 0.03]) if cache_dtype.itemsize == 1 else torch.ones(2)
    shape = (num_blocks, block_size, hk, dim)
    want_k = randn(*shape, seed=5).to(cache_dtype)
    want_v = randn(*shape, seed=6).to(cache_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_q, rot_k = kernels.rope(positions, q, k, rope.cos, rope.sin)
    write_kv(want_k, want_v, rot_k, v, slots, kv_scales)
    got_q = kernels.rope_kv_write(
        positions, q, k, v, rope.cos, rope.sin, got_k, got_v, slots, kv_scales
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    # and RoPE itself against the torch layer, as test_rope
    torch.testing.assert_close(
        got_q, rope(positions, q.float(), k.float())[0].to(dtype), **tol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normed", ["none", "weight", "offset"])
@pytest.mark.parametrize(
    ("tokens", "hq", "hk", "dim"),
    [(16, 4, 1, 256), (37, 9, 3, 64), (3, 2, 1, 16), (1, 16, 4, 64)],
)
def test_qkv_rope_kv_write_gives_the_layered_ops_bits(
    isa, threads, dtype, normed, tokens, hq, hk, dim
) -> None:
    """The decode step's prologue from qkv's rows (Gemma 3's 16 streams split over the
    threads a token at a time, SmolLM2's heads, a single token) equals narrowing qkv, each
    head's ``rms_norm`` through a reshaped copy and ``rope_kv_write``: the same q and cache
    bytes, the untouched slots included."""
    rope = RotaryEmbedding(dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,), generator=generator(3))
    qkv = randn(tokens, (hq + 2 * hk) * dim + 8, dtype=dtype)[:, 8:]  # rows with a stride
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k, v = (x.reshape(tokens, -1, dim) for x in (q, k, v))
    num_blocks = -(-2 * tokens // 8) + 1
    slots = torch.randperm(num_blocks * 8, generator=generator(4))[:tokens]
    shape = (num_blocks, 8, hk, dim)
    want_k, want_v = randn(*shape, seed=5, dtype=dtype), randn(*shape, seed=6, dtype=dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    q_norm = k_norm = None
    offset = normed == "offset"
    if normed != "none":
        q_norm, k_norm = randn(dim, seed=7, dtype=dtype), randn(dim, seed=8, dtype=dtype)
        q = kernels.rms_norm(q.reshape(-1, dim), q_norm, 1e-6, None, offset)[0].view(q.shape)
        k = kernels.rms_norm(k.reshape(-1, dim), k_norm, 1e-5, None, offset)[0].view(k.shape)
    want_q = kernels.rope_kv_write(
        positions, q, k, v, rope.cos, rope.sin, want_k, want_v, slots, torch.ones(2)
    )
    got_q = kernels.qkv_rope_kv_write(
        qkv,
        hq,
        hk,
        dim,
        q_norm,
        1e-6,
        k_norm,
        1e-5,
        offset,
        positions,
        rope.cos,
        rope.sin,
        got_k,
        got_v,
        slots,
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_qkv_rope_kv_write_rejects_bad_arguments() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    qkv = torch.zeros(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    positions, slots = torch.tensor([0, 1]), torch.tensor([0, 9])

    def call(**kw):
        args = {"qkv": qkv, "k_cache": cache, "v_cache": cache.clone(), "slots": slots}
        args.update(kw)
        return kernels.qkv_rope_kv_write(
            args["qkv"],
            2,
            1,
            16,
            args.get("q_norm"),
            1e-6,
            args.get("k_norm"),
            1e-6,
            False,
            positions,
            rope.cos,
            rope.sin,
            args["k_cache"],
            args["v_cache"],
            args["slots"],
        )

    with pytest.raises(RuntimeError, match="outside the cache"):
        call()
    with pytest.raises(RuntimeError, match="int64 slots"):
        call(slots=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="features, expected 64"):
        call(qkv=torch.zeros(2, 48, dtype=torch.bfloat16), slots=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="activation dtype"):
        call(k_cache=cache.float(), v_cache=cache.float(), slots=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="come together"):
        call(q_norm=torch.ones(16, dtype=torch.bfloat16), slots=torch.tensor([0, 1]))


def test_rope_kv_write_rejects_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_kv_write(
            torch.tensor([0]),
            q,
            k,
            k,
            rope.cos,
            rope.sin,
            cache,
            cache.clone(),
            torch.tensor([8]),
            torch.ones(2),
        )


def test_partial_rope_keeps_the_torch_path(isa) -> None:
    """Partial rotary (Phi-4-mini style) is not the kernel's layout: the layer must not call it."""
    rope = RotaryEmbedding(32, 64, 10000.0, None, rotary_dim=16)
    q = randn(3, 2, 32, dtype=torch.bfloat16)
    k = randn(3, 1, 32, dtype=torch.bfloat16, seed=1)
    got_q, got_k = rope(torch.tensor([0, 7, 63]), q, k)
    assert torch.equal(got_q[..., 16:], q[..., 16:]) and torch.equal(got_k[..., 16:], k[..., 16:])
