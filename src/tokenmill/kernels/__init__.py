"""tokenmill's own CPU kernels (a C++ extension, ``csrc/``) and their torch fallbacks' switch.

Model layers call these at a few marked sites (layers.py, quant.py, attention.py); each
site keeps its torch code for tensors the kernels do not take, and for machines where the
extension could not be built (``build.py``).
"""

from tokenmill.kernels.ops import (
    active_isa,
    amx_active,
    available,
    decode_layers,
    describe,
    gemv_bf16,
    gemv_bf16_f32out,
    gemv_f32,
    linear_bf16,
    linear_bf16_f32out,
    linear_int4,
    linear_int4_amx,
    linear_int4_vnni,
    linear_int8,
    linear_int8_amx,
    linear_int8_f32out,
    linear_int8_vnni,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rope,
    rope_kv_write,
    set_enabled,
    set_isa,
    silu_and_mul,
    supports,
)

__all__ = [
    "active_isa",
    "amx_active",
    "available",
    "decode_layers",
    "describe",
    "gemv_bf16",
    "gemv_bf16_f32out",
    "gemv_f32",
    "linear_bf16",
    "linear_bf16_f32out",
    "linear_int4",
    "linear_int4_amx",
    "linear_int4_vnni",
    "linear_int8",
    "linear_int8_amx",
    "linear_int8_f32out",
    "linear_int8_vnni",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rope",
    "rope_kv_write",
    "set_enabled",
    "set_isa",
    "silu_and_mul",
    "supports",
]
