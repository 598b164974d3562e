"""The fake (meta) implementations of the C++ CPU kernels' ops: the output shapes and dtypes
torch.compile traces with, registered once the library is loaded (``build.load``)."""

from __future__ import annotations

import torch


def register_fakes() -> None:
    """Shape functions for torch.compile; called once the library is loaded."""
    lib = "tokenmill_cpu::"

    def linear_fake(x, weight, *rest):
        return x.new_empty(x.shape[0], weight.shape[0])

    torch.library.register_fake(lib + "argmax_rows")(
        lambda x: x.new_empty(x.shape[0], dtype=torch.long)
    )
    for name in ("linear_bf16", "linear_int8", "linear_int4"):
        torch.library.register_fake(lib + name)(linear_fake)
    for name in ("gemv_bf16", "gemv_f32"):
        torch.library.register_fake(lib + name)(
            lambda x, packed, out_features, bias: x.new_empty(x.shape[0], out_features)
        )
    torch.library.register_fake(lib + "gemv_bf16_act")(
        lambda x, packed, out_features, bias, act: x.new_empty(x.shape[0], out_features // 2)
    )
    torch.library.register_fake(lib + "linear_bf16_f32out")(
        lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    )
    torch.library.register_fake(lib + "gemv_bf16_f32out")(
        lambda x, packed, out_features, bias: x.new_empty(
            x.shape[0], out_features, dtype=torch.float32
        )
    )
    for name in ("linear_int8_amx", "linear_int4_amx", "linear_int8_vnni", "linear_int4_vnni"):
        torch.library.register_fake(lib + name)(
            lambda x, tiles, *rest: x.new_empty(x.shape[0], rest[-1])
        )
    for name in ("linear_int8_amx_f32out", "linear_int8_vnni_f32out"):
        torch.library.register_fake(lib + name)(
            lambda x, tiles, *rest: x.new_empty(x.shape[0], rest[-1], dtype=torch.float32)
        )
    torch.library.register_fake(lib + "dequantize_int4")(
        lambda w, scales, offsets, group_size, k: w.new_empty(w.shape[0], k, dtype=torch.float32)
    )
    torch.library.register_fake(lib + "rms_norm")(
        lambda x, w, eps, offset=False: torch.empty_like(x)
    )
    torch.library.register_fake(lib + "add_rms_norm")(
        lambda x, r, w, eps, offset=False: (torch.empty_like(x), torch.empty_like(x))
    )
    for act in ("silu_and_mul", "gelu_tanh_and_mul"):
        torch.library.register_fake(lib + act)(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
    torch.library.register_fake(lib + "rope")(
        lambda pos, q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k))
    )
    torch.library.register_fake(lib + "rope_kv_write")(
        lambda pos, q, k, v, cos, sin, kc, vc, slots, sc: q.new_empty(q.shape)
    )
    torch.library.register_fake(lib + "qkv_rope_kv_write")(
        lambda qkv, hq, hk, d, *rest: qkv.new_empty(qkv.shape[0], hq, d)
    )
    torch.library.register_fake(lib + "paged_decode_attention")(
        lambda q, kc, vc, bt, cl, scale, window, sc, softcap=0.0: q.new_empty(
            q.shape[0], q.shape[1] * q.shape[2]
        )
    )
    torch.library.register_fake(lib + "decode_layers")(
        lambda x, residual, *rest: (torch.empty_like(x), torch.empty_like(x))
    )
    torch.library.register_fake(lib + "paged_prefill_attention")(
        lambda q, kc, vc, bt, cl, qs, scale, window, sc, softcap=0.0: q.new_empty(
            q.shape[0], q.shape[1] * q.shape[2]
        )
    )
