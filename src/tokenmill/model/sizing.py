"""Memory sizing from a ModelConfig alone: weight bytes, KV bytes per token, the KV budget.

The engine (``worker/kv_cache.py``, ``engine/llm_engine.py``) and ``tokenmill plan`` size
memory with these same functions, so the planner's numbers are the engine's. No torch
here: dtypes are names and byte counts, so the planner runs without loading a model.
"""

from __future__ import annotations

from typing import Literal

from tokenmill.model.config import ModelConfig
from tokenmill.model.registry import weight_layout

GIB = 1024**3
ACTIVATION_HEADROOM_BYTES = GIB
"""On CUDA, memory left for activations when the KV budget is a share of the GPU."""

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""Bytes per element of the dtypes weights (``--dtype``) and KV (``--kv-cache-dtype``) use."""

KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
Quantization = Literal["int8", "int4"]
INT4_GROUP_SIZE = 32
"""Default input channels sharing one scale and zero point in int4 weights (``--quantization-group-size``)."""
KERNEL_SCALE_BYTES = 2
"""The int kernels take their scales in bf16/fp16 (an fp32 model's too: ``model/quant.py``)."""


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per K/V element: ``auto`` follows the model's dtype, fp8 is 1, bf16/fp16 are 2."""
    name = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    try:
        return DTYPE_BYTES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; one of {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int) -> int:
    """K and V of one token over all layers (what every KV block is made of)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_bytes


QuantLayout = Literal["torch", "rows", "channels8", "amx", "vnni"]
"""How ``model/quant.py`` stores a quantized projection: for torch's int kernels, as rows for
tokenmill's AVX2 kernels (int4 groups of 32 there: blocks of 8 interleaved channels,
``channels8``), or as AMX tiles (read by AMX, ``amx``, or by AVX-512 VNNI, ``vnni``: the same
bytes; ``quant.kernel_layout`` says which)."""
_TILES = ("amx", "vnni")


def _up(value: int, step: int) -> int:
    return -(-value // step) * step


def projection_weight_bytes(
    out_features: int,
    in_features: int,
    dtype_bytes: int,
    quantization: str | None = None,
    group_size: int = INT4_GROUP_SIZE,
    layout: QuantLayout = "torch",
) -> int:
    """One projection's weight in memory, as ``model/quant.py`` stores it.

    torch's kernels: ``int8`` 1 byte per weight, an fp32 scale per output channel for
    dequantizing and a 16-bit copy for the kernel; ``int4`` half a byte per weight of the
    zero-padded shape (inputs to whole groups, outputs to a multiple of 64), 16-bit scale
    and zero point per group and an fp32 offset per group. tokenmill's kernels: rows, or
    AMX tiles (outputs padded to 16, inputs to 64), with fp32 scales (offsets) and int32
    sums per channel (group), the AMX ones blocked by 16 channels; ``channels8`` (int4 groups
    of 32 on AVX2) fp16 scales and offsets, outputs padded to 8.
    """
    weights = out_features * in_features
    if quantization is None:
        return weights * dtype_bytes
    n16 = _up(out_features, 16)
    if quantization == "int8" and layout == "rows":
        return weights + out_features * (4 + 4)
    if quantization == "int8" and layout in _TILES:
        return n16 * _up(in_features, 64) + out_features * 4 + n16 * (4 + 4)
    if quantization == "int4" and layout == "channels8":  # fp16 scale and offset per group
        k_pad = _up(in_features, max(64, group_size))
        return _up(out_features, 8) * (k_pad // 2 + k_pad // group_size * (2 + 2))
    if quantization == "int4" and layout != "torch":
        k_pad = _up(in_features, max(64, group_size))
        groups = k_pad // group_size
        tiles = (n16 if layout in _TILES else out_features) * k_pad // 2
        blocked = 3 * n16 * groups * 4 if layout in _TILES else 0
        return tiles + out_features * groups * (4 + 4) + blocked
    if quantization == "int8":
        return weights + out_features * (4 + KERNEL_SCALE_BYTES)
    if quantization == "int4":
        padded_in = -(-in_features // group_size) * group_size
        padded_out = -(-out_features // 64) * 64
        groups = padded_in // group_size
        return padded_out * padded_in // 2 + padded_out * groups * (2 * KERNEL_SCALE_BYTES + 4)
    raise ValueError(f"unknown quantization {quantization!r}; one of int8, int4")


def weight_bytes(
    cfg: ModelConfig,
    dtype: str,
    max_model_len: int,
    quantization: str | None = None,
    group_size: int = INT4_GROUP_SIZE,
    layout: QuantLayout = "torch",
    head_layout: QuantLayout = "torch",
) -> int:
    """Everything the model holds on the device: parameters, the fp32 RoPE tables and the
    per-layer KV scales, summed over the registry's layout (``model/registry.py``).

    Quantization applies to the decoder layers' projections (QKV, O, gate/up, down, each
    expert's) and, in int8, to an untied LM head; the embedding, norms, routers and biases
    stay in ``dtype``. ``layout``/``head_layout``: how the layers' and the (int8) head's
    weights are stored.
    """
    nbytes = DTYPE_BYTES[dtype]
    total = 0
    for spec in weight_layout(cfg):
        if spec.kind == "plain":
            total += spec.numel * nbytes
            continue
        head_method = None if quantization is None else "int8"
        method = head_method if spec.kind == "lm_head" else quantization
        out_features, in_features = spec.shape
        total += projection_weight_bytes(
            out_features,
            in_features,
            nbytes,
            method,
            group_size,
            head_layout if spec.kind == "lm_head" else layout,
        )
    num_ropes = 2 if cfg.local_rope_theta is not None else 1
    rotary_dim = cfg.rotary_dim or cfg.head_dim
    rope_tables = num_ropes * 2 * max_model_len * rotary_dim * DTYPE_BYTES["float32"]
    kv_scales = cfg.num_layers * 2 * DTYPE_BYTES["float32"]
    return total + rope_tables + kv_scales


def kv_budget_from_memory(
    kv_cache_memory: float | None,
    total_bytes: int,
    free_bytes: int,
    gpu_memory_utilization: float,
) -> int:
    """The KV budget on a GPU, after the weights are loaded.

    An explicit size (``--kv-cache-memory 4GiB``) is taken as is, a fraction is of free
    memory; by default the engine may use ``gpu_memory_utilization`` of the total, less
    what is already used (weights) and ``ACTIVATION_HEADROOM_BYTES``.
    """
    if kv_cache_memory is not None and kv_cache_memory > 1:
        return int(kv_cache_memory)
    if kv_cache_memory is not None:
        return int(free_bytes * kv_cache_memory)
    used = total_bytes - free_bytes
    return max(0, int(total_bytes * gpu_memory_utilization) - used - ACTIVATION_HEADROOM_BYTES)


CPU_DEFAULT_KV_BUDGET_BYTES = 4 * 1024**3
CPU_DEFAULT_KV_SHARE = 0.25


def cpu_kv_budget(kv_cache_memory: float | None, available_bytes: int) -> int:
    """The KV budget on a CPU, after the weights are loaded.

    An explicit size is taken as is, a fraction is of available memory; by default a quarter
    of available memory, at most ``CPU_DEFAULT_KV_BUDGET_BYTES`` (the pool is mapped lazily,
    so pages a load never touches cost nothing, but the budget caps what it may touch).
    """
    if kv_cache_memory is not None and kv_cache_memory > 1:
        return int(kv_cache_memory)
    if kv_cache_memory is not None:
        return int(available_bytes * kv_cache_memory)
    return int(min(CPU_DEFAULT_KV_BUDGET_BYTES, CPU_DEFAULT_KV_SHARE * available_bytes))


def lora_slot_bytes(cfg: ModelConfig, num_slots: int, max_rank: int, element_bytes: int) -> int:
    """What the LoRA slots (``--max-loras`` of ``--max-lora-rank``) take on the device: per
    layer and fused projection, A ``[slots, in, slices x rank]`` and one B
    ``[slots, rank, out]`` per slice, as ``model.lora.LoRAStacks`` allocates them."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    layout = ((h, (q, kv, kv)), (q, (h,)), (h, (i, i)), (i, (h,)))
    per_slot = sum(
        in_features * len(outs) * max_rank + max_rank * sum(outs) for in_features, outs in layout
    )
    return cfg.num_layers * num_slots * per_slot * element_bytes
