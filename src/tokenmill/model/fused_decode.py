"""A decode step's decoder layers in one call to tokenmill's CPU kernels (``decode_layers``).

One stream's step runs ~130 kernel calls through Python: module calls, the dispatch
checks of each site, q/k/v views and the dispatcher itself, between kernels that often
take a few microseconds (measured with torch.profiler on the 250M Llama, int8, 2 threads:
~3 ms of an 18 ms step outside the kernels). ``decode_layers`` makes the same calls from
C++, in the same order on the same tensors, so its outputs are bit-identical to the
layer-by-layer path; this module encodes the layers for it and says when it applies:
dense decoder layers with pre-norm (Llama, Mistral, Qwen2/3 and the like), sandwich-norm
(Gemma 2/3) or post-norm (OLMo 2) placement whose every projection has a tokenmill kernel for
the activation dtype, on CPU, with no LoRA and no tensor-parallel hooks. q/k norms per head
(Qwen3, Gemma 3) or over all heads (OLMo 2), Gemma's ``1 + weight`` norms, GELU-tanh, sliding
windows, logit soft-capping and a RoPE table of the sliding layers' own (Gemma 3) are
optional fields of a layer. Anything else (sparse MLPs, partial RoPE) runs layer by layer,
and ``refusal`` names the first layer feature that kept it out (the start-up log says it).

Each layer is encoded by name (``EncodedLayer``, its projections as ``Projection``s) and
handed to the C++ side by name too, once: a ``tokenmill_cpu.DecodeLayers`` object takes each
field under its ``EncodedLayer`` name and each projection's arguments under the names in its
op's schema (ops_decode.cpp reads them into a struct and rejects a name it does not know), so
no layout is mirrored between the two languages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill import envs, kernels
from tokenmill.model.attention import FP8_DTYPES, _decode_kernel_applies
from tokenmill.model.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    gelu_tanh_and_mul,
    silu_and_mul,
)
from tokenmill.model.quant import QuantizedLinear

ENV_SWITCH = envs.FUSED_DECODE
"""``0`` runs decode steps layer by layer (A/B runs; ``--no-fused-decode`` at start-up)."""

_OPS = (
    kernels.linear_int8,
    kernels.linear_int4,
    kernels.linear_int4_x8,
    kernels.linear_int8_amx,
    kernels.linear_int4_amx,
    kernels.linear_int8_vnni,
    kernels.linear_int4_vnni,
)
"""The quantized projections' ops that ``decode_layers`` calls (each named as its C++ op)."""


@dataclass(frozen=True)
class Projection:
    """One projection as ``decode_layers`` calls it: the op's name and that op's arguments
    after the activation, by their names in the op's schema (None: an absent bias)."""

    op: str
    args: dict[str, torch.Tensor | int | None]

    @classmethod
    def of_call(cls, op: str, args: tuple[object, ...]) -> Projection:
        """The projection that calls ``op`` with ``args`` after x, positionally as its schema."""
        names = kernels.op_argument_names(op)
        if len(args) != len(names):
            raise ValueError(f"{op} takes {len(names)} arguments after x, got {len(args)}")
        named: dict[str, torch.Tensor | int | None] = {}
        for name, arg in zip(names, args, strict=True):
            if arg is not None and not isinstance(arg, (torch.Tensor, int)):
                raise TypeError(f"{op}: argument {name} is a {type(arg).__name__}")
            named[name] = arg
        return cls(op, named)

    def add_to(self, layers: kernels.DecodeLayers, name: str) -> None:
        """Set this projection as the last added layer's projection ``name``."""
        tensors = {k: v for k, v in self.args.items() if isinstance(v, torch.Tensor)}
        ints = {k: v for k, v in self.args.items() if isinstance(v, int)}
        layers.add_projection(name, self.op, tensors, ints)


ACTIVATIONS = {silu_and_mul: "silu_and_mul", gelu_tanh_and_mul: "gelu_tanh_and_mul"}
"""The MLP activations ``decode_layers`` calls, by their ops' names."""


@dataclass(frozen=True)
class EncodedLayer:
    """One decoder layer, by name: ``add_to`` passes each field to ``decode_layers``'s
    ``DecodeLayers`` under this name; an optional field that is None is left out (the layer
    has no such part).

    Norm placement: pre-norm (Llama) applies ``post_attn_norm`` with the residual add before
    the MLP; sandwich (Gemma 2/3, ``pre_mlp_norm`` and ``post_mlp_norm`` set) applies
    ``post_attn_norm`` to the attention output alone, ``pre_mlp_norm`` with the residual add
    and ``post_mlp_norm`` to the MLP output; post-norm (OLMo 2, no ``input_norm``) feeds the
    running state to the attention and the MLP and normalises each one's output
    (``post_attn_norm``, ``post_mlp_norm``) before it is added."""

    norm_placement: str
    """pre, sandwich or post (``DecoderLayer.placement``)."""
    input_norm_weight: torch.Tensor | None
    """None for post-norm layers."""
    post_attn_norm_weight: torch.Tensor
    kv_scales: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    """0: full attention."""
    norm_offset: bool
    """Every norm scales by ``1 + weight`` (Gemma; the kernel's ``offset`` flag)."""
    input_norm_eps: float | None
    post_attn_norm_eps: float
    scale: float
    logit_softcap: float
    """0: none."""
    activation: str
    """The MLP's gated activation, by its op's name (``ACTIVATIONS``)."""
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    q_norm_weight: torch.Tensor | None = None
    """RMSNorm of q, and ``k_norm_weight`` of k, after the projection and before RoPE: per
    head (Qwen3, Gemma 3), or over all heads with ``qk_norm_full`` (OLMo 2)."""
    qk_norm_full: bool = False
    q_norm_eps: float | None = None
    k_norm_weight: torch.Tensor | None = None
    k_norm_eps: float | None = None
    pre_mlp_norm_weight: torch.Tensor | None = None
    """Sandwich norms (with ``post_mlp_norm_weight``)."""
    pre_mlp_norm_eps: float | None = None
    post_mlp_norm_weight: torch.Tensor | None = None
    post_mlp_norm_eps: float | None = None
    rope_cos: torch.Tensor | None = None
    """This layer's own RoPE table (Gemma 3's sliding layers), with ``rope_sin``; None: the
    step's."""
    rope_sin: torch.Tensor | None = None

    def add_to(self, layers: kernels.DecodeLayers) -> None:
        """Append this layer to a ``kernels.decode_layers_object``, every field by name."""
        tensors: dict[str, torch.Tensor] = {}
        ints: dict[str, int] = {}
        floats: dict[str, float] = {}
        strings: dict[str, str] = {}
        projections: dict[str, Projection] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, Projection):
                projections[field.name] = value
            elif isinstance(value, torch.Tensor):
                tensors[field.name] = value
            elif field.type == "str":
                strings[field.name] = value
            elif field.type.startswith("float"):  # "float" or "float | None"
                floats[field.name] = float(value)
            else:
                ints[field.name] = int(value)
        layers.add_layer(tensors, ints, floats, strings)
        for name, projection in projections.items():
            projection.add_to(layers, name)


@dataclass(frozen=True)
class FusedLayers:
    """The encoded layers, for one ISA and one activation dtype."""

    isa: str
    dtype: torch.dtype
    native: kernels.DecodeLayers
    """The layers as ``decode_layers`` reads them (``kernels.decode_layers_object``), filled
    once from ``layers``; held here for as long as a step may name it by ``handle``."""
    handle: int
    """``native.handle()``: what each step passes."""
    attentions: list[nn.Module]
    """The attention layers, whose fp8 KV scales must be calibrated (by a prefill) first."""
    layers: tuple[EncodedLayer, ...] = ()
    """The same layers on this side, by name."""

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
        op = "gemv_f32" if gemv.dtype == torch.float32 else "gemv_bf16"
        return Projection.of_call(op, (gemv, module.out_features, module.bias))
    if isinstance(module, QuantizedLinear):
        fast = module._fast
        if fast is None or fast[2] != kernels.active_isa() or fast[0] not in _OPS:
            return None
        return Projection.of_call(fast[0].__name__, fast[1])
    return None


def _norm_refusal(norm: nn.Module | None, dtype: torch.dtype, offset: bool) -> str | None:
    """Why ``decode_layers`` cannot call this norm's kernel as ``RMSNorm`` does, or None."""
    if type(norm) is not RMSNorm:
        return f"a norm {type(norm).__name__}"
    if norm.weight.dtype != dtype or norm.weight.device.type != "cpu":
        return f"an RMSNorm weight in {norm.weight.dtype} on {norm.weight.device.type}"
    if norm.offset != offset:
        return "RMSNorms with and without a weight offset"
    return None


def _has_hooks(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def encode(
    layers: nn.ModuleList, dtype: torch.dtype, local_rope: RotaryEmbedding | None = None
) -> FusedLayers | None:
    """The layers encoded for ``decode_layers`` with ``dtype`` activations, or None where any
    layer needs the Python path. ``local_rope``: the sliding layers' own RoPE (Gemma 3's
    ``DecoderModel.local_rope``), else every layer rotates by the step's tables."""
    encoded = _encode(layers, dtype, local_rope)
    return encoded if isinstance(encoded, FusedLayers) else None


def refusal(
    layers: nn.ModuleList, dtype: torch.dtype, local_rope: RotaryEmbedding | None = None
) -> str | None:
    """Why ``encode`` refuses these layers (the first layer feature it cannot call), or None."""
    encoded = _encode(layers, dtype, local_rope)
    return encoded if isinstance(encoded, str) else None


def _layer_refusal(layer: nn.Module, dtype: torch.dtype) -> str | None:
    """The first feature of one layer that ``decode_layers`` does not run, or None."""
    from tokenmill.model.decoder import MLP, Attention, DecoderLayer

    if type(layer) is not DecoderLayer:
        return f"a {type(layer).__name__} layer"
    if _has_hooks(layer):
        return "forward hooks (tensor parallelism)"
    if layer.placement not in ("pre", "sandwich", "post"):
        return f"{layer.placement}-norm placement"
    attn, mlp = layer.attn, layer.mlp
    if type(attn) is not Attention:
        return f"attention {type(attn).__name__}"
    if type(mlp) is not MLP:
        return f"MLP {type(mlp).__name__}"
    if (attn.q_norm is None) != (attn.k_norm is None):
        return "a norm of q or k alone"
    if attn.q_norm is not None and attn.qk_norm not in ("head", "full"):
        return f"q/k norm over {attn.qk_norm}"
    if mlp.act_and_mul not in ACTIVATIONS:
        return f"activation {getattr(mlp.act_and_mul, '__name__', mlp.act_and_mul)}"
    norms = (  # the ones its placement built (DecoderLayer) and its q/k norms
        layer.input_norm,
        layer.post_attn_norm,
        layer.pre_mlp_norm,
        layer.post_mlp_norm,
        attn.q_norm,
        attn.k_norm,
    )
    offset = bool(layer.post_attn_norm.offset)
    for norm in (n for n in norms if n is not None):
        reason = _norm_refusal(norm, dtype, offset)
        if reason is not None:
            return reason
    return None


def _encode(
    layers: nn.ModuleList, dtype: torch.dtype, local_rope: RotaryEmbedding | None
) -> FusedLayers | str:
    """The encoded layers, or why they cannot be encoded."""
    if not kernels.available():
        return "tokenmill's CPU kernels are off or unavailable"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} activations"
    from tokenmill.model.decoder import MLP, Attention, DecoderLayer

    if local_rope is not None and (local_rope.is_partial or local_rope.cos.device.type != "cpu"):
        return "the sliding layers' RoPE is partial or off the CPU"
    encoded: list[EncodedLayer] = []
    attentions: list[nn.Module] = []
    for i, layer in enumerate(layers):
        reason = _layer_refusal(layer, dtype)
        if reason is not None:
            return f"layer {i}: {reason}"
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        modules = {"qkv": attn.qkv, "o": attn.o, "gate_up": mlp.gate_up, "down": mlp.down}
        projections: dict[str, Projection] = {}
        for name, module in modules.items():
            proj = _linear(module)
            if proj is None:
                return f"layer {i}: projection {name} ({type(module).__name__}) has no fixed kernel call"
            if (proj.op == "gemv_f32") != (dtype == torch.float32):
                # the int kernels and gemv_bf16 take bf16 rows only
                return f"layer {i}: projection {name} takes no {dtype} rows"
            projections[name] = proj
        attentions.append(attn)
        # As DecoderModel._layer_rope: sliding layers rotate by their own table where there is one.
        own_rope = local_rope if local_rope is not None and attn.window else None
        encoded.append(
            EncodedLayer(
                norm_placement=layer.placement,
                input_norm_weight=_weight(layer.input_norm),
                post_attn_norm_weight=layer.post_attn_norm.weight,
                kv_scales=attn.kv_scales,
                num_heads=attn.num_heads,
                num_kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim,
                window=attn.window or 0,
                norm_offset=bool(layer.post_attn_norm.offset),
                input_norm_eps=_eps(layer.input_norm),
                post_attn_norm_eps=float(layer.post_attn_norm.eps),
                scale=float(attn.scale),
                logit_softcap=float(attn.logit_softcap or 0.0),
                activation=ACTIVATIONS[mlp.act_and_mul],
                **projections,
                q_norm_weight=_weight(attn.q_norm),
                qk_norm_full=attn.q_norm is not None and attn.qk_norm == "full",
                q_norm_eps=_eps(attn.q_norm),
                k_norm_weight=_weight(attn.k_norm),
                k_norm_eps=_eps(attn.k_norm),
                pre_mlp_norm_weight=_weight(layer.pre_mlp_norm),
                pre_mlp_norm_eps=_eps(layer.pre_mlp_norm),
                post_mlp_norm_weight=_weight(layer.post_mlp_norm),
                post_mlp_norm_eps=_eps(layer.post_mlp_norm),
                rope_cos=None if own_rope is None else own_rope.cos,
                rope_sin=None if own_rope is None else own_rope.sin,
            )
        )
    native = kernels.decode_layers_object()
    for enc in encoded:
        enc.add_to(native)
    return FusedLayers(
        kernels.active_isa(), dtype, native, native.handle(), attentions, tuple(encoded)
    )


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    """An optional norm's weight for ``EncodedLayer`` (None where the layer lacks it)."""
    assert norm is None or isinstance(norm, RMSNorm)  # _layer_refusal checked
    return None if norm is None else norm.weight


def _eps(norm: nn.Module | None) -> float | None:
    assert norm is None or isinstance(norm, RMSNorm)
    return None if norm is None else float(norm.eps)


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
        fused.handle,
    )
