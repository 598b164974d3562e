"""Python entry points to the C++ CPU kernels, with the fake (meta) implementations that let
torch.compile trace them.

Each function takes the tensors as the model layers hold them and reshapes for the op;
``supports(x)`` says whether the kernels serve an activation (a CPU tensor in bfloat16, or
float32 where noted, with the extension loaded). Call sites keep their torch code as the
fallback.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.build import load


def available() -> bool:
    """Whether the extension is loaded and its ops registered (built on first call)."""
    return load()


def supports(x: torch.Tensor, *, float32: bool = False) -> bool:
    """True if the kernels take this activation: CPU, bf16 (or fp32 when ``float32``)."""
    if x.device.type != "cpu" or not available():
        return False
    return x.dtype == torch.bfloat16 or (float32 and x.dtype == torch.float32)


def active_isa() -> str:
    """The kernel table in use: avx512_bf16, avx2, or none."""
    return str(torch.ops.tokenmill_cpu.isa()) if available() else "none"


def set_isa(isa: str) -> str:
    """Switch the kernel table (auto, avx512, avx2) for the whole process; returns the one chosen."""
    return str(torch.ops.tokenmill_cpu.set_isa(isa))


def amx_permitted() -> bool:
    """Whether the Linux kernel granted this process the AMX tile state (arch_prctl)."""
    return bool(torch.ops.tokenmill_cpu.amx_permitted()) if available() else False


def describe() -> str:
    """One line for the start-up log: which kernels run."""
    if not available():
        return "tokenmill CPU kernels off: torch kernels for every op"
    amx = "granted, no AMX kernels yet" if amx_permitted() else "not granted, not used"
    return (
        f"tokenmill CPU kernels ({active_isa()}): bf16/int8/int4 linear up to "
        f"{LINEAR_MAX_ROWS} rows, add+RMSNorm, SiLU*mul, RoPE, paged decode attention; AMX {amx}"
    )


LINEAR_MAX_ROWS = 64
"""Rows up to which a bf16 projection runs the kernel; larger batches (prefill) use oneDNN."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for bf16 x [..., K] and a contiguous bf16 W [N, K]."""
    y = torch.ops.tokenmill_cpu.linear_bf16(_rows(x), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 weights [N, K] with fp32 per-channel scales [N]; x bf16 [M, K]."""
    return torch.ops.tokenmill_cpu.linear_int8(_rows(x), qweight, scales, bias)


def linear_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """int4 weights in ``kernels.int4_layout``'s packing; x bf16 [M, K]."""
    return torch.ops.tokenmill_cpu.linear_int4(_rows(x), packed, scales, zeros, group_size, bias)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x [+ residual]) * weight, x [+ residual]), shaped like x."""
    rows = _rows(x)
    if residual is None:
        return torch.ops.tokenmill_cpu.rms_norm(rows, weight, eps).view(x.shape), x
    out, summed = torch.ops.tokenmill_cpu.add_rms_norm(rows, _rows(residual), weight, eps)
    return out.view(x.shape), summed.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on a fused [..., gate | up]."""
    out = torch.ops.tokenmill_cpu.silu_and_mul(_rows(gate_up))
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] by fp32 tables [P, D]."""
    return torch.ops.tokenmill_cpu.rope(positions, q, k, cos, sin)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    kv_scales: torch.Tensor,
) -> torch.Tensor:
    """One query per row q [B, Hq, D] over the blocks in place; returns [B, Hq * D]."""
    return torch.ops.tokenmill_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, window, kv_scales
    )


def register_fakes() -> None:
    """Shape functions for torch.compile; called once the library is loaded."""
    lib = "tokenmill_cpu::"

    def linear_fake(x, weight, *rest):
        return x.new_empty(x.shape[0], weight.shape[0])

    for name in ("linear_bf16", "linear_int8", "linear_int4"):
        torch.library.register_fake(lib + name)(linear_fake)
    torch.library.register_fake(lib + "rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake(lib + "add_rms_norm")(
        lambda x, r, w, eps: (torch.empty_like(x), torch.empty_like(x))
    )
    torch.library.register_fake(lib + "silu_and_mul")(
        lambda x: x.new_empty(x.shape[0], x.shape[1] // 2)
    )
    torch.library.register_fake(lib + "rope")(
        lambda pos, q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k))
    )
    torch.library.register_fake(lib + "paged_decode_attention")(
        lambda q, kc, vc, bt, cl, scale, window, sc: q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    )
