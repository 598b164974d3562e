"""Python entry points to the C++ CPU kernels: the library's state, the linear ops, norms and
gated activations (attention, RoPE and the fused decode step are in ``kernels/attention_ops.py``;
the fake implementations for torch.compile in ``kernels/fakes.py``).

Each function takes the tensors as the model layers hold them and reshapes for the op;
``supports(x)`` says whether the kernels serve an activation (a CPU tensor in bfloat16, or
float32 where noted, with the extension loaded). Call sites keep their torch code as the
fallback.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.build import load


class _State:
    """What the loaded library chose, read into Python once (and on ``set_isa``), so model
    code traced by torch.compile sees constants instead of calling ops for them."""

    loaded: bool | None = None
    isa = "none"
    amx = False
    amx_bf16 = False
    int8_x_group = 0
    enabled = True

    @classmethod
    def refresh(cls) -> None:
        cls.isa = str(torch.ops.tokenmill_cpu.isa())
        cls.amx = bool(torch.ops.tokenmill_cpu.amx_active())
        cls.amx_bf16 = bool(torch.ops.tokenmill_cpu.amx_bf16_active())
        cls.int8_x_group = int(torch.ops.tokenmill_cpu.int8_x_group())


def available() -> bool:
    """Whether the extension is loaded and its ops registered (built on first call)."""
    if _State.loaded is None:
        _State.loaded = load()
        if _State.loaded:
            _State.refresh()
    return _State.loaded and _State.enabled


def set_enabled(enabled: bool) -> None:
    """Turn the kernels off (or back on) for layers built from now on and for every op
    dispatch; for benchmarks that compare both paths in one process."""
    _State.enabled = enabled


def supports(x: torch.Tensor, *, float32: bool = False) -> bool:
    """True if the kernels take this activation: CPU, bf16 (or fp32 when ``float32``)."""
    if not x.is_cpu or not available():  # is_cpu: no torch.device built per call
        return False
    return x.dtype == torch.bfloat16 or (float32 and x.dtype == torch.float32)


def active_isa() -> str:
    """The kernel table in use: avx512_bf16 (+amx_int8, +amx_bf16), avx2, or none."""
    return _State.isa if available() else "none"


def set_isa(isa: str) -> str:
    """Switch the kernel table (auto, amx, avx512, avx2) for the whole process; returns the
    one chosen. Layers keep the weight layout they were built with."""
    chosen = str(torch.ops.tokenmill_cpu.set_isa(isa))
    _State.refresh()
    return chosen


def int8_activation_group() -> int:
    """Inputs per activation scale of the int8 row kernels (``linear_int8``) now: 64 on the
    AVX2 table, 0 where activations have one scale a row (the AVX-512 table and its tiles)."""
    return _State.int8_x_group if available() else 0


def amx_permitted() -> bool:
    """Whether the Linux kernel granted this process the AMX tile state (arch_prctl)."""
    return bool(torch.ops.tokenmill_cpu.amx_permitted()) if available() else False


def amx_active() -> bool:
    """Whether the int8/int4 projections run on AMX tiles (granted, and not switched off)."""
    return _State.amx if available() else False


def amx_bf16_active() -> bool:
    """Whether bf16 projections of 2 rows or more (batches, prompts) run on AMX-BF16 tiles."""
    return _State.amx_bf16 if available() else False


def describe() -> str:
    """One line for the start-up log: which kernels run."""
    if not available():
        return "tokenmill CPU kernels off: torch kernels for every op"
    if amx_active():
        amx = "AMX-INT8 tiles for int8/int4 projections"
        if amx_bf16_active():
            amx += ", AMX-BF16 tiles for bf16 projections of 2 rows or more"
    elif _State.isa == "avx512_bf16":
        granted = "AMX granted but switched off" if amx_permitted() else "AMX not granted"
        amx = f"{granted}: AVX-512 VNNI on the AMX tile layout for int8/int4 projections"
    elif amx_permitted():
        amx = "AMX granted but switched off"
    else:
        amx = "AMX not granted, not used"
    group = int8_activation_group()
    w8a8 = f"int8 activation scales per {group} inputs, int4 per row" if group else "per row"
    return (
        f"tokenmill CPU kernels ({active_isa()}): int8/int4 linear (W8A8, {w8a8}), add+RMSNorm, "
        f"SiLU*mul, GELU-tanh*mul, RoPE (+ KV write), paged decode and prefill attention "
        f"(split-K, softcap); {amx}"
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.stride(1) == 1:  # the decoder's [tokens, hidden]: no reshape (~1 us)
        return x
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for bf16 x [..., K] and a contiguous bf16 W [N, K]."""
    y = torch.ops.tokenmill_cpu.linear_bf16(_rows(x), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_bf16_f32out(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``linear_bf16`` with fp32 sums returned unrounded (a tied LM head's logits)."""
    y = torch.ops.tokenmill_cpu.linear_bf16_f32out(_rows(x), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def gemv_bf16(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` for bf16 x [..., K] and W in ``kernels.gemv_layout``'s blocks."""
    y = torch.ops.tokenmill_cpu.gemv_bf16(_rows(x), packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def gemv_bf16_f32out(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``gemv_bf16`` with its fp32 sums returned unrounded: an LM head's logits, where bf16
    output would make close candidates tie (then greedy picks the lower token id)."""
    y = torch.ops.tokenmill_cpu.gemv_bf16_f32out(_rows(x), packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def gemv_bf16_act(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    act: str,
) -> torch.Tensor:
    """``act(gate) * up`` of an MLP's fused [gate | up] projection (``out_features`` = 2 x the
    MLP's width), ``act`` "silu" or "gelu_tanh": the bits of ``gemv_bf16`` followed by
    ``silu_and_mul`` / ``gelu_tanh_and_mul``. On AMX-BF16 the activation runs in the GEMM's
    epilogue, so the [rows, out_features] product is never written and read back."""
    y = torch.ops.tokenmill_cpu.gemv_bf16_act(_rows(x), packed, out_features, bias, act)
    return y.view(*x.shape[:-1], out_features // 2)


def gemv_bf16_amx(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    f32_out: bool = False,
) -> torch.Tensor:
    """``gemv_bf16`` (or, ``f32_out``, ``gemv_bf16_f32out``) on the AMX-BF16 tiles at any
    row count; a RuntimeError where they do not run or K is not a multiple of 32. For tests:
    ``gemv_bf16`` picks the tiles itself from 2 rows on."""
    y = torch.ops.tokenmill_cpu.gemv_bf16_amx(_rows(x), packed, out_features, bias, f32_out)
    return y.view(*x.shape[:-1], out_features)


def gemv_f32(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` for fp32 x [..., K] and W in ``gemv_layout.pack_f32``'s blocks."""
    rows = _rows(x)
    y = torch.ops.tokenmill_cpu.gemv_f32(rows, packed, out_features, bias)
    return y if rows is x else y.view(*x.shape[:-1], out_features)


def linear_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """int8 weights [N, K] with fp32 per-channel scales [N] and int32 row sums [N]; x bf16.

    The activations are quantized to signed int8 (W8A8) per row and group of
    ``int8_activation_group()`` (64) inputs, on both tables: VNNI dot products against the
    weights + 128 on AVX-512, ``vpmaddubsw`` on AVX2. ``row_sums`` is checked for the op's
    schema and not read (the AVX-512 kernels undo the + 128 with the activations' sums).
    """
    return torch.ops.tokenmill_cpu.linear_int8(_rows(x), qweight, scales, row_sums, bias)


def linear_int8_f32out(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``linear_int8`` with fp32 outputs: an int8 LM head's logits, not rounded to bf16
    (rounding makes close candidates ties and changed SmolLM2's greedy answers)."""
    return torch.ops.tokenmill_cpu.linear_int8_f32out(_rows(x), qweight, scales, row_sums, bias)


def linear_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """int4 codes in ``kernels.int4_layout``'s packing, ``w = q * scale + offset`` per group
    (fp32 [N, groups] each); x bf16 [M, K]. With groups of 64+ channels the activations are
    quantized per row to int8 (W8A8, both tables), and with groups of 32 on the AVX2 table
    (a GGUF file's Q4 blocks); the AVX-512 table keeps groups of 32 weight-only."""
    return torch.ops.tokenmill_cpu.linear_int4(_rows(x), packed, scales, offsets, group_size, bias)


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """``linear_int4``'s weight as fp32 rows [N, in_features], ``w = q * scale + offset`` per
    group: what a prefill chunk multiplies with torch's fp32 GEMM (``Int4Linear``)."""
    return torch.ops.tokenmill_cpu.dequantize_int4(packed, scales, offsets, group_size, in_features)


def linear_int4_x8(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """int4 codes in groups of 32 with 8 output channels interleaved
    (``int4_layout.pack_channels8``), ``w = q * scale + offset`` per group (scales and offsets
    fp32 blocked [blocks, G, 8]); x bf16 [M, K], quantized per group of 32 (W8A8, as
    ``linear_int4``'s groups of 32 on the AVX2 table). AVX2 code whichever table is active."""
    return torch.ops.tokenmill_cpu.linear_int4_x8(
        _rows(x), packed, scales, offsets, bias, out_features
    )


def dequantize_int4_x8(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    out_features: int,
    in_features: int,
    bf16: bool = False,
) -> torch.Tensor:
    """``linear_int4_x8``'s weight as fp32 rows [out_features, in_features], or with ``bf16``
    those values rounded to bfloat16 in the same pass (an AMX-BF16 prefill GEMM's operand)."""
    return torch.ops.tokenmill_cpu.dequantize_int4_x8(
        packed, scales, offsets, out_features, in_features, bf16
    )


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int, half: bool, levels: tuple[float, ...], rounds: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant_int4._fitted_groups`` in one pass: codes (int32 [rows, in]), scale and low end
    ([rows, groups, 1]) of fp32 ``weight``, each group's least squared error among min-max
    and ``rounds`` least-squares fits from each grid of ``levels`` steps."""
    return torch.ops.tokenmill_cpu.quantize_int4_groups(
        weight, group_size, half, list(levels), rounds
    )


def dequantize_int4_x8_blocks(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """``dequantize_int4_x8(..., bf16=True)``'s values in ``gemv_layout``'s bf16 blocks (the
    padding channels zero; ``in_features`` a multiple of 32): what ``gemv_bf16`` and
    ``gemv_bf16_act`` multiply on AMX-BF16 tiles."""
    return torch.ops.tokenmill_cpu.dequantize_int4_x8_blocks(
        packed, scales, offsets, out_features, in_features
    )


def linear_int8_amx(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """int8 weights in ``amx_layout.pack_int8`` tiles, fp32 scales and int32 row sums blocked
    by ``amx_layout.block_channels`` (the sums checked, not read); activations quantized per
    row and 64-input chunk (W8A8), signed x signed products."""
    return torch.ops.tokenmill_cpu.linear_int8_amx(
        _rows(x), tiles, scales, row_sums, bias, out_features
    )


def linear_int4_amx(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    code_sums: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """int4 codes in ``amx_layout.pack_int4`` tiles, ``w = q * scale + offset`` per group;
    scales, offsets and int32 code sums per group blocked by ``amx_layout.block_channels``.
    Activations quantized per row (W8A8)."""
    return torch.ops.tokenmill_cpu.linear_int4_amx(
        _rows(x), tiles, scales, code_sums, offsets, group_size, bias, out_features
    )


def linear_int8_vnni(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``linear_int8_amx``'s tiles and arguments on AVX-512 VNNI dot products (CPUs without
    AMX; the avx512 table must be active). Activations quantized per row and 64-input chunk
    (W8A8); the same outputs as ``linear_int8_amx``."""
    return torch.ops.tokenmill_cpu.linear_int8_vnni(
        _rows(x), tiles, scales, row_sums, bias, out_features
    )


def linear_int8_amx_f32out(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``linear_int8_amx`` with fp32 outputs, unrounded: a tied int8 LM head's logits."""
    return torch.ops.tokenmill_cpu.linear_int8_amx_f32out(
        _rows(x), tiles, scales, row_sums, bias, out_features
    )


def linear_int8_vnni_f32out(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``linear_int8_vnni`` with fp32 outputs, unrounded (the same values as
    ``linear_int8_amx_f32out``)."""
    return torch.ops.tokenmill_cpu.linear_int8_vnni_f32out(
        _rows(x), tiles, scales, row_sums, bias, out_features
    )


def linear_int4_vnni(
    x: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    code_sums: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``linear_int4_amx``'s tiles and arguments on AVX-512 VNNI dot products (``code_sums``
    is checked, not read: the activations are quantized signed). W8A8 per row."""
    return torch.ops.tokenmill_cpu.linear_int4_vnni(
        _rows(x), tiles, scales, code_sums, offsets, group_size, bias, out_features
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x [+ residual]) * weight, x [+ residual]), shaped like x. ``offset`` (Gemma):
    the scale is ``1 + weight``, applied in fp32 before the one rounding to x's dtype."""
    rows = _rows(x)
    if residual is None:
        out = torch.ops.tokenmill_cpu.rms_norm(rows, weight, eps, offset)
        return (out if rows is x else out.view(x.shape)), x
    out, summed = torch.ops.tokenmill_cpu.add_rms_norm(rows, _rows(residual), weight, eps, offset)
    if rows is x:  # a view costs ~2 us, as much as the kernel on one decode row
        return out, summed
    return out.view(x.shape), summed.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on a fused [..., gate | up]."""
    rows = _rows(gate_up)
    out = torch.ops.tokenmill_cpu.silu_and_mul(rows)
    return out if rows is gate_up else out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up on a fused [..., gate | up], GELU in its tanh form (Gemma's
    ``gelu_pytorch_tanh``), computed in fp32 and rounded to the dtype before the multiply."""
    rows = _rows(gate_up)
    out = torch.ops.tokenmill_cpu.gelu_tanh_and_mul(rows)
    return out if rows is gate_up else out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
