"""A decode step's decoder layers in one call to tokenmill's CPU kernels (``decode_layers``).

One stream's step runs ~130 kernel calls through Python: module calls, the dispatch
checks of each site, q/k/v views and the dispatcher itself, between kernels that often
take a few microseconds (measured with torch.profiler on the 250M Llama, int8, 2 threads:
~3 ms of an 18 ms step outside the kernels). ``decode_layers`` makes the same calls from
C++, in the same order on the same tensors, so its outputs are bit-identical to the
layer-by-layer path; this module encodes the layers for it and says when it applies:
plain pre-norm layers (Llama, Mistral, Qwen2 and the like) whose every projection has a
tokenmill kernel for the activation dtype, on CPU, with no LoRA, no tensor-parallel hooks,
no q/k norm, and one RoPE table for all layers. Anything else runs layer by layer, and
``refusal`` names the first layer feature that kept it out (the start-up log says it).

Each layer is encoded by name (``EncodedLayer``, its projections as ``Projection``s);
``EncodedLayer.slots`` is the one place on this side that lays a layer out the way ops.cpp
reads it (``kLinearTensors``/``kLinearInts`` there, ``LINEAR_TENSORS``/``LINEAR_INTS`` here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill import envs, kernels
from tokenmill.model.attention import FP8_DTYPES, _decode_kernel_applies
from tokenmill.model.layers import Linear, RMSNorm, silu_and_mul
from tokenmill.model.quant import QuantizedLinear

ENV_SWITCH = envs.FUSED_DECODE
"""``0`` runs decode steps layer by layer (A/B runs; ``--no-fused-decode`` at start-up)."""

GEMV_BF16, GEMV_F32, INT8_ROWS, INT4_ROWS, INT8_AMX, INT4_AMX, INT8_VNNI, INT4_VNNI = range(8)
"""Projection kinds, as ops.cpp's ``LinearKind``."""
LINEAR_TENSORS, LINEAR_INTS = 5, 2
"""Tensor and int slots per projection (ops.cpp's ``kLinearTensors`` and ``kLinearInts``)."""

_OP_KINDS = {
    kernels.linear_int8: INT8_ROWS,
    kernels.linear_int4: INT4_ROWS,
    kernels.linear_int8_amx: INT8_AMX,
    kernels.linear_int4_amx: INT4_AMX,
    kernels.linear_int8_vnni: INT8_VNNI,
    kernels.linear_int4_vnni: INT4_VNNI,
}


@dataclass(frozen=True)
class Projection:
    """One projection as ``decode_layers`` calls it: the kernel and that kernel's arguments
    after the activation (tensors first, then ints, as ``_linear`` reads them off the layer)."""

    kind: int
    """One of the kinds above (ops.cpp's ``LinearKind``)."""
    tensors: list[torch.Tensor | None]
    ints: list[int]


@dataclass(frozen=True)
class EncodedLayer:
    """One decoder layer, by name; ``slots`` lays it out the way ops.cpp's ``decode_layers``
    reads a layer (the one place the positional layout is written on this side)."""

    input_norm_weight: torch.Tensor
    post_attn_norm_weight: torch.Tensor
    kv_scales: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    """0: full attention."""
    input_norm_eps: float
    post_attn_norm_eps: float
    scale: float
    logit_softcap: float
    """0: none."""
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection

    def slots(self) -> tuple[list[torch.Tensor | None], list[int], list[float]]:
        """(tensors, ints, floats) of this layer, in ops.cpp's order; each projection padded
        to ``LINEAR_TENSORS`` tensors and ``LINEAR_INTS`` ints."""
        tensors: list[torch.Tensor | None] = [
            self.input_norm_weight,
            self.post_attn_norm_weight,
            self.kv_scales,
        ]
        ints = [self.num_heads, self.num_kv_heads, self.head_dim, self.window]
        for proj in (self.qkv, self.o, self.gate_up, self.down):
            tensors += proj.tensors + [None] * (LINEAR_TENSORS - len(proj.tensors))
            ints += [proj.kind, *proj.ints] + [0] * (LINEAR_INTS - len(proj.ints))
        floats = [self.input_norm_eps, self.post_attn_norm_eps, self.scale, self.logit_softcap]
        return tensors, ints, floats


@dataclass(frozen=True)
class FusedLayers:
    """The encoded layers, for one ISA and one activation dtype."""

    isa: str
    dtype: torch.dtype
    tensors: list[torch.Tensor | None]
    ints: list[int]
    floats: list[float]
    attentions: list[nn.Module]
    """The attention layers, whose fp8 KV scales must be calibrated (by a prefill) first."""
    layers: tuple[EncodedLayer, ...] = ()
    """The same layers by name; ``tensors``, ``ints`` and ``floats`` are their ``slots``,
    concatenated once so that a step passes three ready lists."""

    def applies(self, x: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether these encoded layers run x now (tests switch the ISA after load)."""
        if (
            x.dtype != self.dtype
            or k_cache.device.type != "cpu"
            or self.isa != kernels.active_isa()
            or not _decode_kernel_applies(x, k_cache)  # the layered path's own test
        ):
            return False
        # As the layered path's RoPE + KV write: an fp8 cache once its scales are calibrated.
        return k_cache.dtype not in FP8_DTYPES or all(
            a.kv_scales_calibrated for a in self.attentions
        )


def enabled() -> bool:
    """Whether the environment leaves the fused step on (read at every step)."""
    return not envs.is_off(ENV_SWITCH)


def _linear(module: nn.Module) -> Projection | None:
    """The projection as the C++ op calls it, or None where it has no fixed kernel call."""
    if type(module) is Linear:  # exactly: a subclass may change the forward
        gemv = module.gemv
        if gemv is None:
            return None
        kind = GEMV_F32 if gemv.dtype == torch.float32 else GEMV_BF16
        return Projection(kind, [gemv, module.bias], [module.out_features])
    if isinstance(module, QuantizedLinear):
        fast = module._fast
        if fast is None or fast[2] != kernels.active_isa() or fast[0] not in _OP_KINDS:
            return None
        args = fast[1]
        tensors = [a for a in args if a is None or isinstance(a, torch.Tensor)]
        ints = [a for a in args if isinstance(a, int)]
        return Projection(_OP_KINDS[fast[0]], tensors, ints)
    return None


def _is_plain_norm(norm: nn.Module | None, dtype: torch.dtype) -> bool:
    return (
        type(norm) is RMSNorm
        and not norm.offset
        and norm.weight.dtype == dtype
        and norm.weight.device.type == "cpu"
    )


def _has_hooks(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def encode(layers: nn.ModuleList, dtype: torch.dtype) -> FusedLayers | None:
    """The layers encoded for ``decode_layers`` with ``dtype`` activations, or None where any
    layer needs the Python path."""
    encoded = _encode(layers, dtype)
    return encoded if isinstance(encoded, FusedLayers) else None


def refusal(layers: nn.ModuleList, dtype: torch.dtype) -> str | None:
    """Why ``encode`` refuses these layers (the first layer feature it cannot call), or None."""
    encoded = _encode(layers, dtype)
    return encoded if isinstance(encoded, str) else None


def _layer_refusal(layer: nn.Module, dtype: torch.dtype) -> str | None:
    """The first feature of one layer that ``decode_layers`` does not run, or None."""
    from tokenmill.model.decoder import MLP, Attention, DecoderLayer

    if type(layer) is not DecoderLayer:
        return f"a {type(layer).__name__} layer"
    if _has_hooks(layer):
        return "forward hooks (tensor parallelism)"
    if layer.placement != "pre":
        return f"{layer.placement}-norm placement"
    attn, mlp = layer.attn, layer.mlp
    if type(attn) is not Attention:
        return f"attention {type(attn).__name__}"
    if type(mlp) is not MLP:
        return f"MLP {type(mlp).__name__}"
    if attn.q_norm is not None or attn.k_norm is not None:
        return "per-head q/k norm"
    if mlp.act_and_mul is not silu_and_mul:
        return "an activation other than SiLU"
    if layer.pre_mlp_norm is not None or layer.post_mlp_norm is not None:
        return "norms around the MLP (sandwich norms)"
    if not _is_plain_norm(layer.input_norm, dtype) or not _is_plain_norm(
        layer.post_attn_norm, dtype
    ):
        return "an RMSNorm with a weight offset or another dtype"
    return None


def _encode(layers: nn.ModuleList, dtype: torch.dtype) -> FusedLayers | str:
    """The encoded layers, or why they cannot be encoded."""
    if not kernels.available():
        return "tokenmill's CPU kernels are off or unavailable"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} activations"
    from tokenmill.model.decoder import MLP, Attention, DecoderLayer

    encoded: list[EncodedLayer] = []
    attentions: list[nn.Module] = []
    for i, layer in enumerate(layers):
        reason = _layer_refusal(layer, dtype)
        if reason is not None:
            return f"layer {i}: {reason}"
        assert isinstance(layer, DecoderLayer) and layer.input_norm is not None
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        modules = {"qkv": attn.qkv, "o": attn.o, "gate_up": mlp.gate_up, "down": mlp.down}
        projections: dict[str, Projection] = {}
        for name, module in modules.items():
            proj = _linear(module)
            if proj is None:
                return f"layer {i}: projection {name} ({type(module).__name__}) has no fixed kernel call"
            if (proj.kind == GEMV_F32) != (dtype == torch.float32):
                # the int kernels and gemv_bf16 take bf16 rows only
                return f"layer {i}: projection {name} takes no {dtype} rows"
            if len(proj.tensors) > LINEAR_TENSORS or len(proj.ints) > LINEAR_INTS:
                return f"layer {i}: projection {name} has more arguments than decode_layers takes"
            projections[name] = proj
        attentions.append(attn)
        encoded.append(
            EncodedLayer(
                input_norm_weight=layer.input_norm.weight,
                post_attn_norm_weight=layer.post_attn_norm.weight,
                kv_scales=attn.kv_scales,
                num_heads=attn.num_heads,
                num_kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim,
                window=attn.window or 0,
                input_norm_eps=layer.input_norm.eps,
                post_attn_norm_eps=layer.post_attn_norm.eps,
                scale=attn.scale,
                logit_softcap=attn.logit_softcap or 0.0,
                **projections,
            )
        )
    tensors: list[torch.Tensor | None] = []
    ints: list[int] = []
    floats: list[float] = []
    for enc in encoded:
        layer_tensors, layer_ints, layer_floats = enc.slots()
        tensors += layer_tensors
        ints += layer_ints
        floats += layer_floats
    return FusedLayers(
        kernels.active_isa(), dtype, tensors, ints, floats, attentions, tuple(encoded)
    )


def run(
    fused: FusedLayers,
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer over a decode-only batch x [T, hidden]; returns (x, residual) for the
    final norm."""
    return kernels.decode_layers(
        x,
        positions,
        rope_cos,
        rope_sin,
        slot_mapping,
        block_tables,
        context_lens,
        [k for k, _ in kv_caches],
        [v for _, v in kv_caches],
        fused.tensors,
        fused.ints,
        fused.floats,
    )
