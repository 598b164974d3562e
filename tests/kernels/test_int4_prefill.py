"""int8 and int4 projections on a prefill chunk: the weight dequantized to fp32 and multiplied
by torch's fp32 GEMM from ``dequantized_gemm_rows`` rows on, or to bf16 for a bf16 GEMM on
AMX-BF16 tiles from ``amx_dequantized_gemm_rows`` (on AVX-512 BF16 from
``avx512_dequantized_gemm_rows``, where the int kernel loses to it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import generator, randn
from tokenmill import envs, kernels
from tokenmill.kernels import gemv_layout, int4_layout
from tokenmill.model.layers import silu_and_mul
from tokenmill.model.quant import Int4Linear, quantize_linear
from tokenmill.model.quant_base import in_prompt_chunks, prompt_chunks
from tokenmill.model.quant_int4 import _int4_groups


@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 70), (5, 1000), (64, 576), (130, 257)])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_int4_rebuilds_every_weight(
    threads: int, n: int, k: int, group_size: int
) -> None:
    k_pad = int4_layout.padded_in(k, group_size)
    groups = k_pad // group_size
    codes = torch.randint(0, 16, (n, k_pad), generator=generator(1))
    scales = torch.rand(n, groups, generator=generator(2)) * 0.02 + 1e-3
    offsets = -8 * scales + randn(n, groups, seed=3) * 0.05
    want = codes.float().view(n, groups, group_size) * scales[..., None] + offsets[..., None]
    got = kernels.dequantize_int4(int4_layout.pack(codes), scales, offsets, group_size, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    torch.testing.assert_close(got, want.view(n, k_pad)[:, :k], rtol=0, atol=1e-7)


def test_dequantize_int4_refuses_a_wrong_layout() -> None:
    codes = int4_layout.pack(torch.zeros(4, 64, dtype=torch.long))
    scales = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="scales and offsets must be float32"):
        kernels.dequantize_int4(codes, scales, torch.ones(4, 3), 32, 64)
    with pytest.raises(RuntimeError, match="K_pad a multiple of 64 >= in_features"):
        kernels.dequantize_int4(codes, scales, scales, 32, 65)


@pytest.mark.parametrize(("method", "group_size"), [("int4", 32), ("int4", 128), ("int8", 32)])
def test_a_prefill_chunk_runs_as_an_fp32_gemm(
    isa: str, monkeypatch: pytest.MonkeyPatch, method: str, group_size: int
) -> None:
    """From ``dequantized_gemm_rows`` rows on, the product is the fp32 GEMM of the rebuilt
    weight (activations unquantized), bit for bit; below it, and with the switch off, the
    int kernel's (W8A8 where the table quantizes x), which stays close to it."""
    weight = randn(96, 256, dtype=torch.bfloat16, seed=1)
    bias = randn(96, dtype=torch.bfloat16, seed=2)
    layer = quantize_linear(weight, bias, method, group_size)
    if layer.kernel not in ("rows", "channels8"):
        pytest.skip(f"this table stores {method} as {layer.kernel} tiles")
    if layer.kernel == "channels8" and isa == "avx512_bf16":
        pytest.skip("channels8 stays on its VNNI kernel on AVX-512 (the test below)")
    rows = layer.dequantized_gemm_rows
    assert rows is not None
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    exact = F.linear(x.float(), layer.dequantize(torch.float32), bias.float()).bfloat16()
    assert torch.equal(layer(x), exact)
    assert torch.equal(layer(x.view(2, rows // 2, 256)), exact.view(2, rows // 2, 96))
    few = layer(x[: rows - 1])
    monkeypatch.setenv(envs.PREFILL_GEMM, "0")
    on_kernel = layer(x)
    assert torch.equal(on_kernel[: rows - 1], few)  # the kernel's rows do not depend on the batch
    assert not torch.equal(on_kernel, exact)
    err = (on_kernel.float() - exact.float()).abs().max()
    assert err <= 3e-2 * exact.float().abs().max()


def _kernel_table(isa: str, bf16_tiles: bool) -> Iterator[None]:
    """The ``isa`` kernel table for one test, with AMX-BF16 active (skipped where it cannot
    be) or, a table without tiles, off."""
    try:
        kernels.set_isa(isa)
    except RuntimeError:
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    try:
        if bf16_tiles and not kernels.amx_bf16_active():
            pytest.skip("AMX-BF16 is not active here")
        assert bf16_tiles or not kernels.amx_bf16_active()
        yield
    finally:
        kernels.set_isa("auto")


@pytest.fixture
def amx_bf16_tiles() -> Iterator[None]:
    """The AMX kernel table with AMX-BF16 active for one test."""
    yield from _kernel_table("amx", bf16_tiles=True)


def test_a_prefill_chunk_runs_as_a_bf16_gemm_on_amx(
    amx_bf16_tiles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With AMX-BF16 active, bf16 activations of ``amx_dequantized_gemm_rows`` rows or more
    multiply the weight rebuilt in fp32 and rounded to bf16, by torch's bf16 GEMM, bit for
    bit; one row fewer stays on the int kernel (W8A8, the decode step's numbers). A GGUF
    file's int4 rows; groups quantized at load go to GEMV blocks instead (the test below)."""
    weight = randn(96, 256, dtype=torch.bfloat16, seed=1)
    bias = randn(96, dtype=torch.bfloat16, seed=2)
    # a GGUF file's groups: per-channel rows with fp32 scales
    codes = torch.randint(0, 16, (96, 256), generator=generator(4))
    scale, low = torch.rand(96, 8) * 0.01, torch.rand(96, 8) - 0.5
    layer = Int4Linear(weight, bias, 32, (codes, scale, low))
    assert layer.kernel == "rows"
    rows = layer.amx_dequantized_gemm_rows
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    rebuilt = layer.dequantize(torch.float32).bfloat16()
    gemm = F.linear(x, rebuilt, bias)
    assert torch.equal(layer(x), gemm)
    few = layer(x[: rows - 1])
    monkeypatch.setenv(envs.PREFILL_GEMM, "0")
    on_kernel = layer(x)
    assert torch.equal(on_kernel[: rows - 1], few)
    assert not torch.equal(on_kernel, gemm)


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(44, 96), (64, 256), (100, 32), (13, 576), (3072, 576)]
)
def test_int4_groups_rebuilt_into_gemv_blocks_are_the_bf16_rows_packed(
    isa: str, threads: int, out_features: int, in_features: int
) -> None:
    """``dequantize_int4_x8_blocks`` writes ``gemv_layout``'s blocks of the bf16 rows
    ``dequantize_int4_x8`` gives, padding channels zero, bit for bit, on each table (the
    AVX-512 one has its own code): odd 8-channel block counts (44, 100, 13 channels), a
    partly filled last block (13, 44, 100), SmolLM2's 576 inputs."""
    layer = Int4Linear(randn(out_features, in_features, dtype=torch.bfloat16, seed=1), None, 32)
    assert layer.kernel == "channels8"
    args = (layer.packed, layer.kernel_scales, layer.kernel_offsets, out_features, in_features)
    rows = kernels.dequantize_int4_x8(*args, True)
    assert torch.equal(kernels.dequantize_int4_x8_blocks(*args), gemv_layout.pack(rows))


def test_a_prefill_chunk_on_amx_multiplies_gemv_blocks_with_the_activation_fused(
    amx_bf16_tiles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AMX-BF16, an int4 (groups of 32) prefill chunk is rebuilt into GEMV blocks and
    multiplied by tokenmill's AMX GEMM, the MLP's activation in its epilogue (``gated``), as
    a bf16 projection's; the bf16 rows are not built. One row fewer: the int kernel, which
    has no epilogue (``gated`` is None)."""
    layer = quantize_linear(randn(192, 256, dtype=torch.bfloat16, seed=1), None, "int4", 32)
    rows = layer.amx_dequantized_gemm_rows
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    blocks = gemv_layout.pack(layer.dequantize(torch.float32).bfloat16())
    want = kernels.gemv_bf16(x, blocks, 192, None)
    want_act = kernels.gemv_bf16_act(x, blocks, 192, None, "silu")

    def no_rows(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the bf16 rows were rebuilt")

    monkeypatch.setattr(kernels, "dequantize_int4_x8", no_rows)
    assert torch.equal(layer(x), want)
    fused = layer.gated(x, silu_and_mul)
    assert fused is not None and torch.equal(fused, want_act)
    assert layer.gated(x[: rows - 1], silu_and_mul) is None


def test_a_step_with_prompt_chunks_takes_the_amx_gemm_from_fewer_rows(
    amx_bf16_tiles: None,
) -> None:
    """Groups of 32 in 8 channels: in a step that holds prefill chunks, ``amx_prompt_gemm_rows``
    rows (a 128-token chunk beside 15 decode rows: 143) take the GEMM of the rebuilt GEMV
    blocks; a decode-only step of as many rows keeps the VNNI kernel's numbers, as the
    fused decode step computes them; one row fewer than the threshold, the kernel either way."""
    layer = quantize_linear(randn(192, 256, dtype=torch.bfloat16, seed=1), None, "int4", 32)
    assert isinstance(layer, Int4Linear) and layer.kernel == "channels8"
    rows = layer.amx_prompt_gemm_rows
    assert rows < layer.amx_dequantized_gemm_rows
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    blocks = gemv_layout.pack(layer.dequantize(torch.float32).bfloat16())
    args = (layer.packed, layer.kernel_scales, layer.kernel_offsets, None, 192)
    on_kernel = kernels.linear_int4_x8(x, *args)
    on_blocks = kernels.gemv_bf16(x, blocks, 192, None)
    assert not torch.equal(on_kernel, on_blocks)
    with prompt_chunks(True):
        assert in_prompt_chunks()
        assert torch.equal(layer(x), on_blocks)
        assert torch.equal(layer(x[: rows - 1]), on_kernel[: rows - 1])
    with prompt_chunks(False):
        assert torch.equal(layer(x), on_kernel)
    assert not in_prompt_chunks() and torch.equal(layer(x), on_kernel)


def test_groups_of_32_quantized_at_load_interleave_8_channels(isa: str) -> None:
    """On every table, int4 groups of 32 quantized at load go to 8 interleaved channels
    with fp16 scales and offsets, the codes chosen against those fp16 values; a GGUF file's
    groups (given codes, fp32 scales) keep the rows. Memory sizing counts the same bytes."""
    from tokenmill.model import sizing
    from tokenmill.model.quant import kernel_layout

    weight = randn(44, 96, dtype=torch.bfloat16, seed=1)
    layer = Int4Linear(weight, None, 32)
    assert layer.kernel == "channels8" == kernel_layout("int4", 32)
    assert layer.kernel_scales.dtype == layer.kernel_offsets.dtype == torch.float16
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored == sizing.projection_weight_bytes(44, 96, 2, "int4", 32, "channels8")
    q, scale, low = _int4_groups(weight, 64, 96, 32, half=True)  # the fit, fp16 parameters
    fitted = (q.view(64, 3, 32).float() * scale + low).view(64, 96)[:44]
    assert torch.equal(layer.dequantize(torch.float32), fitted)  # stored as fitted, exactly
    codes = torch.randint(0, 16, (44, 96), generator=generator(1))
    scale, low = torch.rand(44, 3) * 0.01, torch.rand(44, 3) - 0.5
    scale[0, 0] = 1e-3 + 2**-30  # one value fp16 would round keeps the whole tensor in rows
    scale = scale.half().float().where(scale != scale[0, 0], scale)
    low = low.half().float()
    from_file = Int4Linear(weight, None, 32, (codes, scale, low))
    assert from_file.kernel == "rows"
    want = codes.float().view(44, 3, 32) * scale[..., None] + low[..., None]
    assert torch.equal(from_file.dequantize(torch.float32), want.view(44, 96))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_gguf_files_fp16_groups_interleave_8_channels_bit_for_bit(isa: str, qtype: str) -> None:
    """A file's groups whose scales and offsets are fp16 values (Q4_0: d and -8d, Q4_1: d
    and m, both stored as fp16) go to the 8 interleaved channels, rebuilding the file's
    weights exactly, and run the same op as groups quantized at load."""
    codes = torch.randint(0, 16, (44, 96), generator=generator(1))
    d = (torch.rand(44, 3, generator=generator(2)) * 0.01 + 1e-4).half().float()
    low = -8 * d if qtype == "Q4_0" else (torch.rand(44, 3) - 0.5).half().float()
    weight = randn(44, 96, dtype=torch.bfloat16, seed=3)
    layer = Int4Linear(weight, None, 32, (codes, d, low))
    assert layer.kernel == "channels8"
    want = codes.float().view(44, 3, 32) * d[..., None] + low[..., None]
    assert torch.equal(layer.dequantize(torch.float32), want.view(44, 96))
    x = randn(5, 96, dtype=torch.bfloat16, seed=4)
    args = (layer.packed, layer.kernel_scales, layer.kernel_offsets, None, 44)
    assert torch.equal(layer(x), kernels.linear_int4_x8(x, *args))


@pytest.fixture
def avx512_no_amx() -> Iterator[None]:
    """The AVX-512 table (AVX-512 BF16 dot products, AMX off) for one test."""
    yield from _kernel_table("avx512", bf16_tiles=False)


def test_groups_of_32_stay_on_the_vnni_kernel_at_every_row_count_on_avx512(
    avx512_no_amx: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AVX-512 without AMX, int4 in 8 interleaved channels is never dequantized for a GEMM
    (its VNNI kernel beat both the fp32 and the bf16 GEMM at 1024 rows): a prefill chunk of
    ``dequantized_gemm_rows`` rows and more gives the kernel's rows, bit for bit, as with
    the switch off, and ``gated`` leaves the activation to the MLP."""
    weight = randn(96, 256, dtype=torch.bfloat16, seed=1)
    bias = randn(96, dtype=torch.bfloat16, seed=2)
    layer = quantize_linear(weight, bias, "int4", 32)
    assert layer.kernel == "channels8"

    def no_dequantize(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the weight was dequantized")

    for name in ("dequantize_int4_x8", "dequantize_int4_x8_blocks"):
        monkeypatch.setattr(kernels, name, no_dequantize)
    rows = 2 * layer.dequantized_gemm_rows
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    kernel = kernels.linear_int4_x8(
        x, layer.packed, layer.kernel_scales, layer.kernel_offsets, bias, 96
    )
    assert torch.equal(layer(x), kernel)
    assert torch.equal(layer(x[:17]), kernel[:17])  # rows do not depend on the batch
    assert layer.gated(x, silu_and_mul) is None


def test_a_gguf_files_groups_run_as_a_bf16_gemm_on_avx512(
    avx512_no_amx: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AVX-512 without AMX, a GGUF file's int4 groups (the rows layout) multiply a prefill
    chunk of ``avx512_dequantized_gemm_rows`` rows or more by the weight rebuilt in fp32 and
    rounded to bf16, through torch's bf16 GEMM, bit for bit; one row fewer stays on the int
    kernel, as does the chunk with the switch off."""
    weight = randn(96, 256, dtype=torch.bfloat16, seed=1)
    bias = randn(96, dtype=torch.bfloat16, seed=2)
    codes = torch.randint(0, 16, (96, 256), generator=generator(4))
    scale, low = torch.rand(96, 8) * 0.01, torch.rand(96, 8) - 0.5
    layer = Int4Linear(weight, bias, 32, (codes, scale, low))
    assert layer.kernel == "rows"
    rows = layer.avx512_dequantized_gemm_rows
    assert rows is not None and rows < layer.dequantized_gemm_rows
    x = randn(rows, 256, dtype=torch.bfloat16, seed=3)
    gemm = F.linear(x, layer.dequantize(torch.float32).bfloat16(), bias)
    assert torch.equal(layer(x), gemm)
    few = layer(x[: rows - 1])
    monkeypatch.setenv(envs.PREFILL_GEMM, "0")
    on_kernel = layer(x)
    assert torch.equal(on_kernel[: rows - 1], few)
    assert not torch.equal(on_kernel, gemm)
