"""Each C++ kernel against a torch reference: odd shapes, every dtype it takes, both ISAs
(AVX-512 BF16 and AVX2), one and two threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import (
    DTYPES,
    SHAPES,
    close_to_fp32,
    generator,
    randn,
    tol,
)
from tokenmill import kernels
from tokenmill.kernels import int4_layout
from tokenmill.kernels import ops as kernels_ops
from tokenmill.model.layers import RMSNorm


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16(isa: str, threads: int, m: int, n: int, k: int, with_bias: bool) -> None:
    x, w = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2) if with_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    got = kernels.linear_bf16(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    close_to_fp32(got, want, 1e-2)


def test_linear_bf16_keeps_leading_dims_and_strided_rows(isa: str) -> None:
    x = randn(2, 3, 80, dtype=torch.bfloat16)[..., :72]  # rows with a stride
    w = randn(40, 72, dtype=torch.bfloat16, seed=1)
    got = kernels.linear_bf16(x, w, None)
    assert got.shape == (2, 3, 40)
    close_to_fp32(got, F.linear(x.float(), w.float()), 1e-2)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES + [(1, 19, 300), (1, 40, 1024)])
def test_linear_int8(isa: str, threads: int, m: int, n: int, k: int) -> None:
    x = randn(m, k, dtype=torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.02 + 1e-3
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    row_sums = q.int().sum(1, dtype=torch.int32)
    want = F.linear(x.float(), q.float() * scales[:, None], bias.float())
    got = kernels.linear_int8(x, q, scales, row_sums, bias)
    # activations quantized to int8 per row (AVX-512) or group of 64 (AVX2): about 0.4% of
    # the largest value sharing the scale
    close_to_fp32(got, want, 2e-2)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 37, 70),
        (3, 5, 96),
        (2, 16, 64),
        (5, 64, 200),
        (16, 33, 256),
        # several groups of 128+: the two-chunk GEMV path, with row tails (N % 4) and K tails
        (1, 67, 640),
        (2, 6, 1000),
        (3, 130, 384),
    ],
)
@pytest.mark.parametrize("group_size", [32, 64, 128, 512])
def test_linear_int4(isa: str, threads: int, m: int, n: int, k: int, group_size: int) -> None:
    k_pad = int4_layout.padded_in(k, group_size)
    groups = k_pad // group_size
    codes = torch.randint(0, 16, (n, k_pad), generator=generator(1))
    scales = torch.rand(n, groups, generator=generator(2)) * 0.02 + 1e-3
    offsets = -8 * scales + randn(n, groups, seed=3) * 0.05
    x = randn(m, k, dtype=torch.bfloat16)
    w = codes.float().view(n, groups, group_size) * scales[..., None] + offsets[..., None]
    want = F.linear(x.float(), w.view(n, k_pad)[:, :k])
    got = kernels.linear_int4(x, int4_layout.pack(codes), scales, offsets, group_size, None)
    close_to_fp32(got, want, 3e-2)  # W8A8: x rounded to int8 per row (up to 2.4% seen here)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_linear_int4_groups_of_32_quantize_x_per_group(isa: str, m: int) -> None:
    """Groups of 32 (GGUF's Q4 blocks) quantize each row's activations per group of 32 on
    AVX2, as llama.cpp's Q8 blocks do: one large activation then costs only its own group's
    precision. With one scale a row, a 1000x outlier flattened every other group to a few
    levels (the error test below fails at 1e-2 with per-row scales)."""
    n, k = 7, 1000
    k_pad = int4_layout.padded_in(k, 32)
    codes = torch.randint(0, 16, (n, k_pad), generator=generator(1))
    scales = torch.rand(n, k_pad // 32, generator=generator(2)) * 0.02 + 1e-3
    offsets = -8 * scales + randn(n, k_pad // 32, seed=3) * 0.05
    x = randn(m, k, dtype=torch.bfloat16)
    x[:, 5] = 1000.0  # an outlier channel, as trained models have
    w = codes.float().view(n, -1, 32) * scales[..., None] + offsets[..., None]
    got = kernels.linear_int4(x, int4_layout.pack(codes), scales, offsets, 32, None)
    want = F.linear(x.float(), w.view(n, k_pad)[:, :k])
    w = w.view(n, k_pad)[:, :k]
    rest = F.linear(x.float()[:, 32:], w[:, 32:])  # the groups without the outlier
    beside = x.float()[:, :32].clone()
    beside[:, 5] = 0
    lost = F.linear(beside, w[:, :32]).abs()  # at most what the outlier's own group loses
    err = (got.float() - want).abs()
    if isa == "avx2":  # per group: the other groups keep their precision
        bound = 1e-2 * rest.abs().max() + lost + want.abs() * 2**-8  # + bf16 output rounding
        assert (err <= bound).all(), (err - bound).max().item()
    else:  # weight-only groups of 32 on the AVX-512 table
        close_to_fp32(got, want, 3e-2)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("group_size", [128, 256, 512])
def test_linear_int4_extreme_codes_and_activations_do_not_overflow(
    isa: str, m: int, group_size: int
) -> None:
    """Every code 15 against activations at +-max: the AVX2 kernels sum code x activation
    pairs in int16 over up to 4 chunks of 64 before widening (|sum| <= 30480 < 32767)."""
    n, k = 6, 1024
    groups = k // group_size
    codes = torch.full((n, k), 15)
    scales = torch.full((n, groups), 0.01)
    offsets = torch.full((n, groups), -0.05)
    x = torch.ones(m, k, dtype=torch.bfloat16)
    x[1::2] = -1  # odd rows at the negative extreme
    w = codes.float().view(n, groups, group_size) * scales[..., None] + offsets[..., None]
    want = F.linear(x.float(), w.view(n, k))
    got = kernels.linear_int4(x, int4_layout.pack(codes), scales, offsets, group_size, None)
    close_to_fp32(got, want, 1e-2)


@pytest.mark.parametrize(("method", "group_size"), [("int8", 0), ("int4", 128), ("int4", 32)])
def test_int_rows_do_not_depend_on_the_batch(isa: str, method: str, group_size: int) -> None:
    """The W8A8 row kernels give a row alone (the one-row GEMVs) the bits it gets inside a
    batch (the 4-row tiles): integer sums are exact, and the epilogues sum in one order. int8
    on both tables; int4 on AVX2 (groups of 32, GGUF's Q4 blocks, run their own tiles)."""
    if isa != "avx2" and method != "int8":
        pytest.skip("the AVX2 W8A8 int4 row kernels' property")
    n, k = 37, 640
    x = randn(11, k, dtype=torch.bfloat16)
    bias = randn(n, seed=4)
    if method == "int8":
        w = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
        scales = torch.rand(n, generator=generator(2)) * 0.01 + 1e-3
        sums = w.sum(1, dtype=torch.int32)
        run = lambda rows: kernels.linear_int8(rows, w, scales, sums, bias)  # noqa: E731
    else:
        codes = torch.randint(0, 16, (n, k), generator=generator(1))
        scales = torch.rand(n, k // group_size, generator=generator(2)) * 0.02 + 1e-3
        offsets = randn(n, k // group_size, seed=3) * 0.05
        packed = int4_layout.pack(codes)
        run = lambda rows: kernels.linear_int4(rows, packed, scales, offsets, group_size, bias)  # noqa: E731
    batch = run(x)
    for i in range(11):
        assert torch.equal(run(x[i : i + 1])[0], batch[i]), i


def test_int4_layout_round_trips() -> None:
    codes = torch.randint(0, 16, (7, 192), generator=generator(0))
    assert torch.equal(int4_layout.unpack(int4_layout.pack(codes)).long(), codes)


def _channels8(n: int, k: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Random int4 groups of 32 for ``linear_int4_x8``: its packed codes, fp16 blocked scales
    and offsets, and the weight they stand for (fp32 [n, k])."""
    k_pad, n8 = int4_layout.padded_in(k, 32), -(-n // 8) * 8
    groups = k_pad // 32
    codes = torch.randint(0, 16, (n8, k_pad), generator=generator(seed))
    scales = (torch.rand(n8, groups, generator=generator(seed + 1)) * 0.02 + 1e-3).half()
    offsets = (-8 * scales.float() + randn(n8, groups, seed=seed + 2) * 0.05).half()
    w = codes.float().view(n8, groups, 32) * scales.float()[..., None] + offsets.float()[..., None]
    block = int4_layout.block_channels8
    packed = int4_layout.pack_channels8(codes)
    return packed, block(scales), block(offsets), w.view(n8, k_pad)[:n, :k]


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 8, 32),
        (1, 37, 70),
        (3, 5, 96),
        (4, 64, 576),
        (5, 130, 257),
        (9, 16, 1536),
        (16, 33, 1000),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int4_x8(isa: str, threads: int, m: int, n: int, k: int, with_bias: bool) -> None:
    """8 interleaved channels (AVX2 code on either table): channel tails (n % 8), input tails
    to whole 64-wide chunks, one row and 4-row tiles with row tails."""
    packed, scales, offsets, w = _channels8(n, k)
    x = randn(m, k, dtype=torch.bfloat16)
    bias = randn(n, seed=4) if with_bias else None
    got = kernels.linear_int4_x8(x, packed, scales, offsets, bias, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    close_to_fp32(got, F.linear(x.float(), w, bias), 3e-2)  # x rounded to int8 per group of 32
    assert torch.equal(kernels.dequantize_int4_x8(packed, scales, offsets, n, k), w)
    as_bf16 = kernels.dequantize_int4_x8(packed, scales, offsets, n, k, bf16=True)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, w.bfloat16())


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 70), (4, 64, 576), (5, 130, 257), (7, 8, 64), (16, 24, 1536)]
)
def test_linear_int4_x8_gives_the_same_bits_on_both_tables(
    threads: int, m: int, n: int, k: int
) -> None:
    """The AVX-512 table's kernel (two 8-channel blocks a vector, VNNI) against the AVX2 one:
    the same bits, an odd block count's last block alone included."""
    packed, scales, offsets, _ = _channels8(n, k)
    x = randn(m, k, dtype=torch.bfloat16)
    bias = randn(n, seed=4)
    got = {}
    try:
        for table in ("avx2", "avx512"):
            try:
                kernels.set_isa(table)
            except RuntimeError:
                pytest.skip(f"this CPU cannot run the {table} kernels")
            got[table] = kernels.linear_int4_x8(x, packed, scales, offsets, bias, n)
    finally:
        kernels.set_isa("auto")
    assert torch.equal(got["avx2"], got["avx512"])


def test_linear_int4_x8_equals_the_rows_kernel_per_group(isa: str) -> None:
    """The same codes, scales and x quantization as the per-channel rows of groups of 32: the
    integer sums are exact, so only the fp32 order of the group sums may differ (within a
    bf16 rounding of the output)."""
    if isa != "avx2":
        pytest.skip("the rows kernel quantizes x per group of 32 on the AVX2 table only")
    n, k = 40, 640
    packed, scales, offsets, _ = _channels8(n, k)
    codes = int4_layout.unpack_channels8(packed)[:n]
    unblock = lambda v: v.transpose(1, 2).reshape(-1, v.shape[1])[:n].float().contiguous()  # noqa: E731
    x = randn(6, k, dtype=torch.bfloat16)
    x[:, 5] = 300.0  # one group's scale far from the others'
    rows = kernels.linear_int4(
        x, int4_layout.pack(codes), unblock(scales), unblock(offsets), 32, None
    )
    got = kernels.linear_int4_x8(x, packed, scales, offsets, None, n)
    close_to_fp32(got, rows.float(), 2**-7)


def test_linear_int4_x8_extreme_codes_and_activations_do_not_overflow(isa: str) -> None:
    """Every code 15 against activations at +-max: a group's 8 vpmaddubsw pairs sum in int16
    (|sum| <= 8 * 2 * 15 * 127 = 30480 < 32767)."""
    n, k = 16, 256
    codes = torch.full((n, k), 15)
    scales = torch.full((n, k // 32), 0.01).half()
    offsets = torch.full((n, k // 32), -0.05).half()
    block = int4_layout.block_channels8
    x = torch.ones(3, k, dtype=torch.bfloat16)
    x[1] = -1
    w = codes.float() * 0.01 - 0.05
    got = kernels.linear_int4_x8(
        x, int4_layout.pack_channels8(codes), block(scales), block(offsets), None, n
    )
    close_to_fp32(got, F.linear(x.float(), w), 1e-2)


def test_linear_int4_x8_rows_do_not_depend_on_the_batch(isa: str) -> None:
    """A row alone (the one-stream decode) gets the bits it gets inside a 4-row tile."""
    n, k = 37, 640
    packed, scales, offsets, _ = _channels8(n, k)
    x, bias = randn(11, k, dtype=torch.bfloat16), randn(n, seed=4)
    batch = kernels.linear_int4_x8(x, packed, scales, offsets, bias, n)
    for i in range(11):
        alone = kernels.linear_int4_x8(x[i : i + 1], packed, scales, offsets, bias, n)
        assert torch.equal(alone[0], batch[i]), i


def test_linear_int4_x8_refuses_a_layout_it_cannot_read() -> None:
    packed, scales, offsets, _ = _channels8(16, 64)
    x = randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16"):
        kernels.linear_int4_x8(x, packed, scales.float(), offsets.float(), None, 16)
    with pytest.raises(RuntimeError, match="pack_channels8"):
        kernels.linear_int4_x8(x, packed, scales, offsets, None, 17)  # 3 blocks' worth


def test_int4_channels8_layout_round_trips() -> None:
    codes = torch.randint(0, 16, (24, 192), generator=generator(0))
    packed = int4_layout.pack_channels8(codes)
    assert packed.shape == (3, 6, 128)
    assert torch.equal(int4_layout.unpack_channels8(packed).long(), codes)
    # word t of block b, group g: channel c's byte i holds inputs 8t + i (low) and 8t + 4 + i
    b, g, t, c, i = 1, 4, 2, 5, 3
    byte = int(packed[b, g, 32 * t + 4 * c + i])
    row = codes[8 * b + c, 32 * g :]
    assert byte & 15 == row[8 * t + i] and byte >> 4 == row[8 * t + 4 + i]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (3, 37), (17, 1024), (130, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(isa, threads, dtype, rows: int, dim: int, with_residual: bool) -> None:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = 1 + 0.1 * randn(dim, seed=5)
    norm = norm.to(dtype)
    x = randn(rows, dim, dtype=dtype)
    residual = randn(rows, dim, dtype=dtype, seed=1) if with_residual else None
    want, want_sum = norm(
        x, residual
    )  # the torch code (the layer calls the kernel only on request)
    got, got_sum = kernels.rms_norm(x, norm.weight, 1e-6, residual)
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (3, 37), (17, 1024), (130, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_a_weight_offset(
    isa, threads, dtype, rows: int, dim: int, with_residual: bool
) -> None:
    """Gemma's scale ``1 + weight``, applied in fp32 before the one rounding: as the torch code."""
    norm = RMSNorm(dim, 1e-6, offset=True)
    norm.weight.data = 0.3 * randn(dim, seed=5)
    norm = norm.to(dtype)
    x = randn(rows, dim, dtype=dtype)
    residual = randn(rows, dim, dtype=dtype, seed=1) if with_residual else None
    summed = x if residual is None else x + residual
    got, got_sum = kernels.rms_norm(x, norm.weight, 1e-6, residual, offset=True)
    torch.testing.assert_close(got, norm._norm(summed), **tol(dtype))
    torch.testing.assert_close(got_sum, summed, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 16), (3, 37), (64, 2816), (5, 1)])
def test_silu_and_mul(isa, threads, dtype, rows: int, dim: int) -> None:
    x = randn(rows, 2 * dim, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 16), (3, 37), (64, 2816), (5, 1)])
def test_gelu_tanh_and_mul(isa, threads, dtype, rows: int, dim: int) -> None:
    x = randn(rows, 2 * dim, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(kernels.gelu_tanh_and_mul(x), want, **tol(dtype))
    # far into both tails, where tanh saturates
    gate = torch.linspace(-60, 60, 257, dtype=dtype).view(1, -1)
    got = kernels.gelu_tanh_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh"), **tol(dtype))


@pytest.mark.parametrize(("n", "k"), [(37, 70), (32, 128), (48, 640)])
def test_pack_int8_in_chunks_and_in_place(monkeypatch, n: int, k: int) -> None:
    """The tiles packed a few blocks at a time (chunks of 2 KB here) are the whole tensor's;
    given up and needing no padding, the weight's own storage holds them."""
    from tokenmill.kernels import amx_layout

    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator(0))
    whole = amx_layout._tiles(q).view(-(-n // 16), -(-k // 64), 16, 64)
    monkeypatch.setattr(amx_layout, "CHUNK_BYTES", 2048)
    assert torch.equal(amx_layout.pack_int8(q), whole)
    given = q.clone()
    tiles = amx_layout.pack_int8(given, reuse_storage=True)
    assert torch.equal(tiles, whole)
    in_place = n % 16 == 0 and k % 64 == 0
    assert (tiles.data_ptr() == given.data_ptr()) == in_place


@pytest.fixture
def amx() -> None:
    if not kernels.amx_active():
        pytest.skip("AMX tiles are not granted (or are switched off) in this process")


@pytest.mark.parametrize(("m", "n", "k"), SHAPES + [(40, 33, 200)])
def test_linear_int8_amx(amx, threads: int, m: int, n: int, k: int) -> None:
    from tokenmill.kernels import amx_layout

    x = randn(m, k, dtype=torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.02 + 1e-3
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    row_sums = q.int().sum(1, dtype=torch.int32)
    want = F.linear(x.float(), q.float() * scales[:, None], bias.float())
    block = amx_layout.block_channels
    got = kernels.linear_int8_amx(
        x, amx_layout.pack_int8(q), block(scales), block(row_sums), bias, n
    )
    assert got.shape == (m, n)
    close_to_fp32(got, want, 2e-2)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 70), (3, 5, 96), (2, 16, 64), (17, 64, 200), (40, 33, 256)]
)
@pytest.mark.parametrize("group_size", [64, 128])
def test_linear_int4_amx(amx, threads: int, m: int, n: int, k: int, group_size: int) -> None:
    from tokenmill.kernels import amx_layout

    k_pad = int4_layout.padded_in(k, group_size)
    groups = k_pad // group_size
    codes = torch.randint(0, 16, (n, k_pad), generator=generator(1))
    codes[:, k:] = 0
    scales = torch.rand(n, groups, generator=generator(2)) * 0.02 + 1e-3
    offsets = -8 * scales + randn(n, groups, seed=3) * 0.05
    x = randn(m, k, dtype=torch.bfloat16)
    w = codes.float().view(n, groups, group_size) * scales[..., None] + offsets[..., None]
    want = F.linear(x.float(), w.view(n, k_pad)[:, :k])
    code_sums = codes.view(n, groups, group_size).sum(-1).int()
    tiles = amx_layout.pack_int4(codes)
    block = amx_layout.block_channels
    got = kernels.linear_int4_amx(
        x, tiles, block(scales), block(code_sums), block(offsets), group_size, None, n
    )
    close_to_fp32(got, want, 2e-2)


@pytest.fixture
def vnni(isa: str) -> str:
    """The VNNI tile ops run on the avx512 table only; under avx2 they must refuse."""
    return isa


VNNI_SHAPES = [(1, 1, 32), (1, 37, 70), (2, 16, 64), (3, 5, 96), (5, 64, 33), (7, 100, 200)]
VNNI_SHAPES += [(16, 130, 257), (17, 65, 130), (40, 33, 256), (64, 48, 128), (100, 80, 64)]
"""Rows 1 (the GEMV), 2-6 (one row tile), 7+ (several, uneven); channels not whole 64-channel
tiles or 16-channel blocks; inputs not whole 64-input chunks."""


@pytest.mark.parametrize(("m", "n", "k"), VNNI_SHAPES)
def test_linear_int8_vnni(vnni: str, threads: int, m: int, n: int, k: int) -> None:
    from tokenmill.kernels import amx_layout

    x = randn(m, k, dtype=torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.02 + 1e-3
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    row_sums = q.int().sum(1, dtype=torch.int32)
    want = F.linear(x.float(), q.float() * scales[:, None], bias.float())
    block = amx_layout.block_channels
    args = (x, amx_layout.pack_int8(q), block(scales), block(row_sums), bias, n)
    if vnni == "avx2":
        with pytest.raises(RuntimeError, match="avx512 table"):
            kernels.linear_int8_vnni(*args)
        return
    got = kernels.linear_int8_vnni(*args)
    assert got.shape == (m, n)
    # activations quantized per 64-input chunk to int8: about 0.4% of its largest value
    close_to_fp32(got, want, 2e-2)


def test_int8_tiles_do_not_depend_on_the_batch_or_on_amx(vnni: str) -> None:
    """The VNNI tiles give a row alone (their GEMV) the bits it gets in a batch of row tiles,
    and AMX (where granted) the same bits as VNNI: each 64-input chunk's integer sums are
    exact and both scale them in the same float steps."""
    from tokenmill.kernels import amx_layout

    if vnni == "avx2":
        pytest.skip("the VNNI tile ops run on the avx512 table")
    n, k = 70, 200
    x = randn(11, k, dtype=torch.bfloat16)
    x[:, 3] = 300.0  # an outlier: one chunk's scale far from the others'
    q = torch.randint(-127, 128, (n, k), generator=generator(1), dtype=torch.int8)
    scales = torch.rand(n, generator=generator(2)) * 0.01 + 1e-3
    block = amx_layout.block_channels
    args = (amx_layout.pack_int8(q), block(scales), block(q.sum(1, dtype=torch.int32)))
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    batch = kernels.linear_int8_vnni(x, *args, bias, n)
    for i in range(11):
        assert torch.equal(kernels.linear_int8_vnni(x[i : i + 1], *args, bias, n)[0], batch[i]), i
    if kernels_ops.amx_permitted():
        kernels.set_isa("amx")
        try:
            assert torch.equal(kernels.linear_int8_amx(x, *args, bias, n), batch)
            assert torch.equal(kernels.linear_int8_amx(x[:1], *args, bias, n)[0], batch[0])
        finally:
            kernels.set_isa("avx512")


@pytest.mark.parametrize(("m", "n", "k"), VNNI_SHAPES[1:] + [(2, 67, 640), (9, 20, 1000)])
@pytest.mark.parametrize("group_size", [64, 128, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_int4_vnni(
    vnni: str, threads: int, m: int, n: int, k: int, group_size: int, with_bias: bool
) -> None:
    from tokenmill.kernels import amx_layout

    k_pad = int4_layout.padded_in(k, group_size)
    groups = k_pad // group_size
    codes = torch.randint(0, 16, (n, k_pad), generator=generator(1))
    codes[:, k:] = 0
    scales = torch.rand(n, groups, generator=generator(2)) * 0.02 + 1e-3
    offsets = -8 * scales + randn(n, groups, seed=3) * 0.05
    x = randn(m, k, dtype=torch.bfloat16)
    bias = randn(n, dtype=torch.bfloat16, seed=4) if with_bias else None
    w = codes.float().view(n, groups, group_size) * scales[..., None] + offsets[..., None]
    want = F.linear(x.float(), w.view(n, k_pad)[:, :k], None if bias is None else bias.float())
    block = amx_layout.block_channels
    code_sums = block(codes.view(n, groups, group_size).sum(-1).int())
    tiles = amx_layout.pack_int4(codes)
    args = (x, tiles, block(scales), code_sums, block(offsets), group_size, bias, n)
    if vnni == "avx2":
        with pytest.raises(RuntimeError, match="avx512 table"):
            kernels.linear_int4_vnni(*args)
        return
    close_to_fp32(kernels.linear_int4_vnni(*args), want, 2e-2)
