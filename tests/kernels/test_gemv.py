"""tokenmill's GEMV over ``kernels.gemv_layout``'s blocks (bf16 and fp32), on each kernel table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import SHAPES, close_to_fp32, randn
from tokenmill import kernels
from tokenmill.kernels import gemv_layout

GEMV_SHAPES = [
    (4, 17, 1000),
    (9, 33, 64),
    (13, 20, 7),
    (24, 50, 33),
    (70, 47, 101),
    (129, 16, 64),
    (300, 20, 999),
]
"""AVX-512: every row count up to 16 has its own tile, more rows go 8 x 3 blocks in 64-row
chunks. AVX2: tiles of up to 4 (bf16) or 6 (fp32) rows x 1 block, in chunks of ~128K fp32 x
values (126-128 rows at K = 999). These cover every row tail, 1- and 2-block tails, odd K and
chunk boundaries of both tables."""


@pytest.mark.parametrize(("m", "n", "k"), SHAPES + GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16(isa: str, threads: int, m: int, n: int, k: int, with_bias: bool) -> None:
    """Each weight line is read once per row tile; odd K pads the last pair with zero."""
    x, w = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2) if with_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    got = kernels.gemv_bf16(x, gemv_layout.pack(w), n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    close_to_fp32(got, want, 1e-2)


def test_gemv_bf16_keeps_leading_dims_and_strided_rows(isa: str) -> None:
    x = randn(2, 3, 80, dtype=torch.bfloat16)[..., :72]
    w = randn(40, 72, dtype=torch.bfloat16, seed=1)
    got = kernels.gemv_bf16(x, gemv_layout.pack(w), 40, None)
    assert got.shape == (2, 3, 40)
    close_to_fp32(got, F.linear(x.float(), w.float()), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_gemv_rows_do_not_depend_on_the_batch(isa: str, dtype: torch.dtype) -> None:
    """On AVX2 each output sums its products in k order whatever the tile: a row alone gives
    the bits it gives inside a batch (an embedding request alone equals the same input in a
    batch). AVX-512 splits one row's sum over chains for latency, so it is not checked."""
    if isa != "avx2":
        pytest.skip("batch invariance is the AVX2 tiles' property")
    x, w = randn(11, 300, dtype=dtype), randn(40, 300, dtype=dtype, seed=1)
    if dtype == torch.float32:
        packed, op = gemv_layout.pack_f32(w), kernels.gemv_f32
    else:
        packed, op = gemv_layout.pack(w), kernels.gemv_bf16
    batch = op(x, packed, 40, None)
    for i in range(11):
        assert torch.equal(op(x[i : i + 1], packed, 40, None)[0], batch[i]), i


def test_gemv_layout_round_trips_and_rejects_other_shapes() -> None:
    w = randn(37, 70, dtype=torch.bfloat16)
    packed = gemv_layout.pack(w)
    assert packed.shape == (3, 35, 16, 2)
    assert torch.equal(gemv_layout.unpack(packed, 37, 70), w)
    with pytest.raises(RuntimeError, match="gemv_bf16"):  # packed for another K
        kernels.gemv_bf16(randn(1, 100, dtype=torch.bfloat16), packed, 37, None)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES + GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_f32(isa: str, threads: int, m: int, n: int, k: int, with_bias: bool) -> None:
    """fp32 blocks: one line per input, every row tile, block tails and odd K."""
    x, w = randn(m, k), randn(n, k, seed=1)
    bias = randn(n, seed=2) if with_bias else None
    got = kernels.gemv_f32(x, gemv_layout.pack_f32(w), n, bias)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_gemv_f32_keeps_leading_dims_and_strided_rows(isa: str) -> None:
    x = randn(2, 3, 80)[..., :72]
    w = randn(40, 72, seed=1)
    got = kernels.gemv_f32(x, gemv_layout.pack_f32(w), 40, None)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_gemv_f32_layout_round_trips_and_rejects_other_shapes() -> None:
    w = randn(37, 70)
    packed = gemv_layout.pack_f32(w)
    assert packed.shape == (3, 70, 16)
    assert torch.equal(gemv_layout.unpack_f32(packed, 37), w)
    with pytest.raises(RuntimeError, match="gemv_f32"):  # packed for another K
        kernels.gemv_f32(randn(1, 100), packed, 37, None)
    with pytest.raises(RuntimeError, match="float32"):  # bf16 rows
        kernels.gemv_f32(randn(1, 70, dtype=torch.bfloat16), packed, 37, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_in_chunks_and_reading_rows_back(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight packed a few blocks at a time (odd N and K, a short last chunk) gives the
    blocks one whole-tensor pack gives, and ``rows`` reads any row back exactly: a tied head
    packed for the GEMV is also the embedding table."""
    pack, unpack = (
        (gemv_layout.pack, lambda p: gemv_layout.unpack(p, 37, 71))
        if dtype == torch.bfloat16
        else (gemv_layout.pack_f32, lambda p: gemv_layout.unpack_f32(p, 37))
    )
    w = randn(37, 71, dtype=dtype)
    whole = pack(w)
    monkeypatch.setattr(gemv_layout, "CHUNK_ELEMENTS", 16 * 72)  # one block a chunk
    chunked = pack(w)
    assert torch.equal(chunked, whole) and torch.equal(unpack(chunked), w)
    ids = torch.tensor([[0, 36, 15], [16, 17, 0]])
    got = gemv_layout.rows(chunked, ids, 71)
    assert got.dtype == dtype and got.shape == (2, 3, 71)
    assert torch.equal(got, w[ids])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_over_the_weight_gives_the_same_blocks(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reuse_storage`` (the loader gives its copy up): a weight that needs no padding is
    packed over itself, a few blocks at a time, into the blocks a new tensor would get; one
    that needs padding is packed into a new tensor and left as it was."""
    pack = gemv_layout.pack if dtype == torch.bfloat16 else gemv_layout.pack_f32
    monkeypatch.setattr(gemv_layout, "CHUNK_ELEMENTS", 3 * 16 * 70)  # 3 blocks a chunk
    w = randn(80, 70, dtype=dtype)
    want = pack(w)
    mine = w.clone()
    got = pack(mine, reuse_storage=True)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got, want)
    odd = randn(37, 71, dtype=dtype)
    kept = odd.clone()
    got = pack(kept, reuse_storage=True)
    assert got.data_ptr() != kept.data_ptr() and torch.equal(kept, odd)
    assert torch.equal(got, pack(odd))
    part = randn(64, 70, dtype=dtype)[:32]  # a view of a larger storage: not taken over
    assert pack(part, reuse_storage=True).data_ptr() != part.data_ptr()


AMX_SHAPES = [
    (1, 16, 32),
    (2, 37, 64),
    (15, 33, 96),
    (16, 48, 576),
    (17, 20, 32),
    (31, 70, 160),
    (33, 64, 64),
    (300, 47, 96),
    (40, 33, 512),
    (300, 20, 800),
]
"""AMX-BF16 tiles: 16-row blocks two at a time (tails of 1-15 rows in either), 256-row chunks
(300), channel blocks in pairs with a lone last block and a partial one; K whole tiles of 32,
in one pass over K or in passes of 256 inputs (576, 512, 800: a short last pass or none)."""


@pytest.fixture
def amx_bf16() -> None:
    if not kernels.amx_bf16_active():
        pytest.skip("AMX-BF16 tiles are not granted (or are switched off) in this process")


@pytest.mark.parametrize(("m", "n", "k"), AMX_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16_on_amx_tiles(
    amx_bf16, threads: int, m: int, n: int, k: int, with_bias: bool
) -> None:
    """The tiles read gemv_layout's blocks as they are: bf16 out rounded from fp32 sums, and
    the fp32 sums themselves for logits (products of bf16 are exact in fp32, so only the
    order of the additions differs from the reference)."""
    x, w = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2) if with_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    packed = gemv_layout.pack(w)
    got = kernels.gemv_bf16_amx(x, packed, n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    close_to_fp32(got, want, 1e-2)
    logits = kernels.gemv_bf16_amx(x, packed, n, bias, f32_out=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-4)


def test_gemv_bf16_on_amx_tiles_in_row_chunks_of_strided_rows(amx_bf16, threads: int) -> None:
    """Over 256 rows the tiles take the rows 256 at a time: each chunk's rows are read at the
    input's row stride and written at the output's, bf16 and fp32 out alike."""
    x = randn(600, 100, dtype=torch.bfloat16)[:, :96]
    w = randn(40, 96, dtype=torch.bfloat16, seed=1)
    want = F.linear(x.float(), w.float())
    packed = gemv_layout.pack(w)
    close_to_fp32(kernels.gemv_bf16(x, packed, 40, None), want, 1e-2)
    torch.testing.assert_close(
        kernels.gemv_bf16_f32out(x, packed, 40, None), want, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("n", [1024, 1000])
def test_gemv_bf16_outputs_past_l2_are_streamed_with_the_same_bits(
    amx_bf16, threads: int, n: int
) -> None:
    """Outputs of 2 MiB or more leave the tiles through non-temporal whole-line stores (the
    last partial block as before): the same bits as the same rows in smaller calls, whose
    outputs are stored in place, and close to fp32."""
    x, w = randn(1100, 64, dtype=torch.bfloat16), randn(n, 64, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2)
    packed = gemv_layout.pack(w)
    whole = kernels.gemv_bf16(x, packed, n, bias)
    assert whole.numel() * 2 >= 2 << 20
    parts = torch.cat(
        [kernels.gemv_bf16(x[i : i + 100], packed, n, bias) for i in range(0, 1100, 100)]
    )
    assert torch.equal(whole, parts)
    close_to_fp32(whole, F.linear(x.float(), w.float(), bias.float()), 1e-2)


def test_gemv_bf16_takes_the_amx_tiles_from_two_rows(amx_bf16) -> None:
    """Two rows or more with K whole tiles go to AMX (the same bits as the tiles' op), one row
    to the GEMV (whose sums are ordered differently, so the bits differ), and K that is not
    whole tiles to the GEMV at any row count."""
    x, w = randn(5, 96, dtype=torch.bfloat16), randn(40, 96, dtype=torch.bfloat16, seed=1)
    packed = gemv_layout.pack(w)
    assert torch.equal(
        kernels.gemv_bf16(x, packed, 40, None), kernels.gemv_bf16_amx(x, packed, 40, None)
    )
    assert torch.equal(
        kernels.gemv_bf16_f32out(x[:2], packed, 40, None),
        kernels.gemv_bf16_amx(x[:2], packed, 40, None, f32_out=True),
    )
    one = kernels.gemv_bf16_f32out(x[:1], packed, 40, None)
    assert not torch.equal(one, kernels.gemv_bf16_amx(x[:1], packed, 40, None, f32_out=True))
    torch.testing.assert_close(one, F.linear(x[:1].float(), w.float()), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gemv_bf16_amx(
            randn(3, 70, dtype=torch.bfloat16),
            gemv_layout.pack(randn(8, 70, dtype=torch.bfloat16)),
            8,
            None,
        )


def test_gemv_bf16_amx_refuses_without_amx(isa: str) -> None:
    """With AMX switched off (the avx512 and avx2 tables) the tiles' op says so."""
    w = randn(16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        kernels.gemv_bf16_amx(randn(2, 64, dtype=torch.bfloat16), gemv_layout.pack(w), 16, None)


GATED_SHAPES = [
    (2, 64, 64),
    (17, 96, 576),
    (33, 128, 32),
    (300, 160, 96),
    (40, 64, 288),
    (1, 64, 64),
    (5, 48, 64),
    (4, 64, 70),
]
"""An MLP's [gate | up]: rows in 16-row tails, 256-row chunks (300) and one row (the GEMV),
gate widths of 1-5 blocks; then widths that are not whole blocks (48: 24 a half) and K that is
not whole tiles, which run the GEMV and the activation op after it wherever AMX is."""


@pytest.mark.parametrize(("m", "n", "k"), GATED_SHAPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_projection_gives_the_layered_bits(
    threads: int, m: int, n: int, k: int, act: str
) -> None:
    """``gemv_bf16_act`` is ``gemv_bf16`` followed by the activation op, to the bit, whether
    the activation runs in the AMX GEMM's epilogue or after the GEMV; and both are close to
    the activation of fp32 sums."""
    x, w = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2)
    packed = gemv_layout.pack(w)
    layered_act = kernels.silu_and_mul if act == "silu" else kernels.gelu_tanh_and_mul
    for b in (None, bias):
        got = kernels.gemv_bf16_act(x, packed, n, b, act)
        assert got.shape == (m, n // 2) and got.dtype == torch.bfloat16
        assert torch.equal(got, layered_act(kernels.gemv_bf16(x, packed, n, b)))
        gate, up = F.linear(x.float(), w.float(), None if b is None else b.float()).chunk(2, -1)
        fn = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
        close_to_fp32(got, fn * up, 3e-2)


@pytest.mark.parametrize("width", [1024, 1008])
def test_gated_projection_past_l2_gives_the_layered_bits(
    amx_bf16, threads: int, width: int
) -> None:
    """A gated output of 2 MiB or more leaves the tiles two gate blocks (one line a row) at a
    time through non-temporal stores, a last odd block on its own (1008: 63 blocks); rows
    over several passes of K: the bits of the GEMV's product then the activation op, and of
    the same rows in smaller calls, whose outputs are stored in place."""
    x, w = (
        randn(1100, 288, dtype=torch.bfloat16),
        randn(2 * width, 288, dtype=torch.bfloat16, seed=1),
    )
    bias = randn(2 * width, dtype=torch.bfloat16, seed=2)
    packed = gemv_layout.pack(w)
    whole = kernels.gemv_bf16_act(x, packed, 2 * width, bias, "silu")
    assert whole.numel() * 2 >= 2 << 20
    assert torch.equal(whole, kernels.silu_and_mul(kernels.gemv_bf16(x, packed, 2 * width, bias)))
    parts = torch.cat(
        [
            kernels.gemv_bf16_act(x[i : i + 100], packed, 2 * width, bias, "silu")
            for i in range(0, 1100, 100)
        ]
    )
    assert torch.equal(whole, parts)


def test_gated_projection_on_every_table(isa: str) -> None:
    """Without AMX (the avx512 and avx2 tables) the op runs the GEMV, then the activation."""
    x, w = randn(40, 64, dtype=torch.bfloat16), randn(96, 64, dtype=torch.bfloat16, seed=1)
    packed = gemv_layout.pack(w)
    assert torch.equal(
        kernels.gemv_bf16_act(x, packed, 96, None, "silu"),
        kernels.silu_and_mul(kernels.gemv_bf16(x, packed, 96, None)),
    )


def test_gated_projection_strided_rows_and_bad_arguments(amx_bf16) -> None:
    """Rows at a stride over 256 rows keep the layered bits; an unknown activation or an odd
    width is refused."""
    x = randn(600, 100, dtype=torch.bfloat16)[:, :96]
    w = randn(64, 96, dtype=torch.bfloat16, seed=1)
    packed = gemv_layout.pack(w)
    assert torch.equal(
        kernels.gemv_bf16_act(x, packed, 64, None, "gelu_tanh"),
        kernels.gelu_tanh_and_mul(kernels.gemv_bf16(x, packed, 64, None)),
    )
    with pytest.raises(RuntimeError, match="silu or gelu_tanh"):
        kernels.gemv_bf16_act(x, packed, 64, None, "relu")
    odd = gemv_layout.pack(randn(33, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="even"):
        kernels.gemv_bf16_act(x, odd, 33, None, "silu")


@pytest.mark.parametrize("act", [None, "silu"])
def test_amx_outputs_left_pending_between_tasks_are_written_to_their_own_rows(
    amx_bf16, threads: int, act: str | None
) -> None:
    """At K = 2,048 a task is one channel pair (or one gated group): each call's last outputs
    stay pending on its thread and the thread's next task writes them, whatever row chunk
    that task is in (700 rows: 256, 256 and 188), and the last ones are written when the
    thread has no task left. The same bits as the rows in calls of 100 (other chunks, other
    tasks), and close to fp32."""
    n, k = 320, 2048
    x, w = randn(700, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1)
    bias = randn(n, dtype=torch.bfloat16, seed=2)
    packed = gemv_layout.pack(w)

    def op(rows: torch.Tensor) -> torch.Tensor:
        if act is None:
            return kernels.gemv_bf16(rows, packed, n, bias)
        return kernels.gemv_bf16_act(rows, packed, n, bias, act)

    whole = op(x)
    assert torch.equal(whole, torch.cat([op(x[i : i + 100]) for i in range(0, 700, 100)]))
    want = F.linear(x.float(), w.float(), bias.float())
    if act is not None:
        gate, up = want.chunk(2, -1)
        want = F.silu(gate) * up
    close_to_fp32(whole, want, 3e-2)
    if act is None:
        torch.testing.assert_close(
            kernels.gemv_bf16_f32out(x, packed, n, bias), want, rtol=1e-5, atol=1e-3
        )
