"""The model registry: architecture name -> model class, family flags and checkpoint layout.

A family is described here once. ``weight_layout`` lists every tensor the model holds,
where it comes from in the checkpoint (several names are concatenated along dim 0 into
one fused parameter) and whether it is a projection (quantized and prepacked at load);
the loader's shape checks and reads, ``ModelConfig.num_params``, ``sizing.weight_bytes``
and LoRA's fused layout are all derived from that list. Adding a family that fits the
shared decoder is an entry in ``ARCHITECTURES``: its flags and its checkpoint naming.

No torch here (``tokenmill plan`` sizes models without it): model classes are named by
import path and imported only when a model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:
    from tokenmill.model.config import ModelConfig

WeightKind = Literal["plain", "projection", "expert", "lm_head"]


@dataclass(frozen=True)
class FamilySpec:
    """What distinguishes one family inside the shared decoder (defaults: Llama)."""

    qkv_bias: bool = False
    """q/k/v projections always carry a bias (Qwen2); else ``attention_bias`` decides."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm of q and k: per head (Qwen3, Gemma 3) or over all heads at once (OLMo 2)."""
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """``pre``: norm before attention and MLP (Llama). ``post``: norm of their outputs
    (OLMo 2). ``sandwich``: both (Gemma 2/3)."""
    uses_sliding_window: bool = False
    gemma: bool = False
    """Gemma conventions: RMSNorm scales by ``1 + weight``, embeddings are multiplied by
    sqrt(hidden_size), GELU-tanh MLP, ``query_pre_attn_scalar``, soft-capping."""
    moe: Literal["none", "mixtral", "qwen2_moe", "qwen3_moe"] = "none"
    """Which sparse MLP block, if any (the router's normalisation differs by family)."""
    rope_per_layer_type: bool = False
    """Sliding layers have their own RoPE base (Gemma 3's ``rope_local_base_freq``)."""


@dataclass(frozen=True)
class CheckpointNaming:
    """How a family names its tensors in a Hugging Face checkpoint."""

    fused_qkv: bool = False
    """One ``qkv_proj`` tensor instead of q/k/v (Phi-3)."""
    fused_gate_up: bool = False
    """One ``gate_up_proj`` tensor instead of gate/up (Phi-3)."""
    moe_block: str = "mlp"
    """Name of the sparse block inside a layer (Mixtral: ``block_sparse_moe``)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """(gate, up, down) inside each expert (Mixtral: w1, w3, w2)."""


@dataclass(frozen=True)
class ArchSpec:
    """One registered architecture."""

    name: str
    family: FamilySpec = field(default_factory=FamilySpec)
    naming: CheckpointNaming = field(default_factory=CheckpointNaming)
    model_class: str = "tokenmill.model.decoder:DecoderModel"
    """``module:Class`` of the model, imported only when it is built."""


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("LlamaForCausalLM"),
        ArchSpec("MistralForCausalLM", FamilySpec(uses_sliding_window=True)),
        ArchSpec("Qwen2ForCausalLM", FamilySpec(qkv_bias=True, uses_sliding_window=True)),
        ArchSpec("Qwen3ForCausalLM", FamilySpec(qk_norm="head", uses_sliding_window=True)),
        ArchSpec("Olmo2ForCausalLM", FamilySpec(qk_norm="full", norm_placement="post")),
        ArchSpec(
            "Phi3ForCausalLM",
            FamilySpec(uses_sliding_window=True),
            CheckpointNaming(fused_qkv=True, fused_gate_up=True),
        ),
        ArchSpec(
            "Gemma2ForCausalLM",
            FamilySpec(norm_placement="sandwich", uses_sliding_window=True, gemma=True),
        ),
        ArchSpec(
            "Gemma3ForCausalLM",
            FamilySpec(
                qk_norm="head",
                norm_placement="sandwich",
                uses_sliding_window=True,
                gemma=True,
                rope_per_layer_type=True,
            ),
        ),
        ArchSpec(
            "MixtralForCausalLM",
            FamilySpec(uses_sliding_window=True, moe="mixtral"),
            CheckpointNaming(moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2")),
        ),
        ArchSpec(
            "Qwen2MoeForCausalLM",
            FamilySpec(qkv_bias=True, uses_sliding_window=True, moe="qwen2_moe"),
        ),
        ArchSpec(
            "Qwen3MoeForCausalLM",
            FamilySpec(qk_norm="head", uses_sliding_window=True, moe="qwen3_moe"),
        ),
    )
}
"""Every architecture tokenmill runs natively, by the name in ``config.json``."""


def resolve_model_impl(architecture: str | None, requested: str) -> tuple[str, str]:
    """(``native`` or ``transformers``, why) for ``--model-impl requested``.

    ``auto`` runs a registered family natively and anything else through the Transformers
    fallback (``model/transformers_fallback.py``); ``native`` refuses what is not registered.
    """
    is_native = architecture in ARCHITECTURES
    if requested == "transformers":
        return "transformers", "--model-impl transformers"
    if requested == "native":
        if not is_native:
            lookup(architecture)  # raises, naming what is supported
        return "native", f"--model-impl native; {architecture} is a native family"
    if is_native:
        return "native", f"{architecture} is a native family (--model-impl auto)"
    return "transformers", (
        f"{architecture} is not a native family, so --model-impl auto runs Transformers' "
        "modeling code over tokenmill's KV cache"
    )


def lookup(architecture: str | None, source: str = "config.json") -> ArchSpec:
    """The registered spec, or a ModelLoadError naming the file and what is supported."""
    spec = ARCHITECTURES.get(architecture or "")
    if spec is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architecture!r}; supported natively: "
            f"{sorted(ARCHITECTURES)} (others may run with --model-impl transformers)"
        )
    return spec


def model_class(cfg: ModelConfig) -> type:
    """The class that implements ``cfg``'s architecture (imported now)."""
    module, _, name = lookup(cfg.architecture).model_class.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


@dataclass(frozen=True)
class WeightSpec:
    """One parameter of the model and the checkpoint tensors it is read from."""

    target: str
    """Dotted path of the parameter in the model, e.g. ``layers.0.attn.qkv.weight``."""
    sources: tuple[str, ...]
    """Checkpoint tensor names, concatenated along dim 0 in this order."""
    shapes: tuple[tuple[int, ...], ...]
    """Expected shape of each source."""
    kind: WeightKind = "plain"
    """``projection``: a decoder projection (quantized, or prepacked for oneDNN); ``expert``:
    an MoE expert's projection (quantized, never prepacked: oneDNN's layout for 32 rows was
    1.4-1.7x slower at the 1-16 rows an expert gets per decode step); ``lm_head``: the
    untied head."""
    lora: tuple[str, tuple[int, ...]] | None = None
    """(fused projection name, output size of each logical slice) where LoRA may attach."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the (fused) parameter."""
        return (sum(s[0] for s in self.shapes), *self.shapes[0][1:])

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def layer(self) -> int | None:
        """The decoder layer it belongs to, None for embeddings, final norm and head."""
        parts = self.target.split(".")
        return int(parts[1]) if parts[0] == "layers" else None


def _one(
    target: str, source: str, shape: tuple[int, ...], kind: WeightKind = "plain"
) -> WeightSpec:
    return WeightSpec(target, (source,), (shape,), kind)


def _projection(
    target: str,
    sources: Sequence[tuple[str, tuple[int, ...]]],
    lora: str | None,
    slices: tuple[int, ...] | None = None,
    kind: WeightKind = "projection",
) -> WeightSpec:
    shapes = tuple(s for _, s in sources)
    slice_outs = slices if slices is not None else tuple(s[0] for s in shapes)
    return WeightSpec(
        target + ".weight",
        tuple(n for n, _ in sources),
        shapes,
        kind,
        None if lora is None else (lora, slice_outs),
    )


def _mlp(
    target: str,
    source: str,
    names: tuple[str, str, str],
    hidden: int,
    inter: int,
    fused: bool = False,
    bias: bool = False,
    lora: bool = False,
    kind: WeightKind = "projection",
) -> list[WeightSpec]:
    """A gated MLP: [gate|up] fused into ``gate_up``, then ``down``."""
    gate, up, down = names
    if fused:
        gate_up_sources = [(f"{source}.gate_up_proj.weight", (2 * inter, hidden))]
    else:
        gate_up_sources = [
            (f"{source}.{gate}.weight", (inter, hidden)),
            (f"{source}.{up}.weight", (inter, hidden)),
        ]
    specs = [
        _projection(
            f"{target}.gate_up",
            gate_up_sources,
            "gate_up" if lora else None,
            (inter, inter),
            kind,
        ),
        _projection(
            f"{target}.down",
            [(f"{source}.{down}.weight", (hidden, inter))],
            "down" if lora else None,
            kind=kind,
        ),
    ]
    if bias:
        specs += [
            WeightSpec(
                f"{target}.gate_up.bias",
                (f"{source}.{gate}.bias", f"{source}.{up}.bias"),
                ((inter,), (inter,)),
            ),
            _one(f"{target}.down.bias", f"{source}.{down}.bias", (hidden,)),
        ]
    return specs


def _layer_layout(cfg: ModelConfig, spec: ArchSpec, n: int) -> list[WeightSpec]:
    naming = spec.naming
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, cfg.q_size, cfg.kv_size
    src, dst = f"model.layers.{n}", f"layers.{n}"
    a = f"{src}.self_attn"
    if naming.fused_qkv:
        qkv_sources = [(f"{a}.qkv_proj.weight", (q + 2 * kv, h))]
    else:
        qkv_sources = [
            (f"{a}.q_proj.weight", (q, h)),
            (f"{a}.k_proj.weight", (kv, h)),
            (f"{a}.v_proj.weight", (kv, h)),
        ]
    specs = [
        _projection(f"{dst}.attn.qkv", qkv_sources, "qkv", (q, kv, kv)),
        _projection(f"{dst}.attn.o", [(f"{a}.o_proj.weight", (h, q))], "o"),
    ]
    if cfg.qkv_bias:
        specs.append(
            WeightSpec(
                f"{dst}.attn.qkv.bias",
                (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
                ((q,), (kv,), (kv,)),
            )
        )
    if cfg.o_bias:
        specs.append(_one(f"{dst}.attn.o.bias", f"{a}.o_proj.bias", (h,)))
    if cfg.qk_norm != "none":
        q_dim, k_dim = (d, d) if cfg.qk_norm == "head" else (q, kv)
        specs.append(_one(f"{dst}.attn.q_norm.weight", f"{a}.q_norm.weight", (q_dim,)))
        specs.append(_one(f"{dst}.attn.k_norm.weight", f"{a}.k_norm.weight", (k_dim,)))
    norms = {
        "pre": [("input_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm")],
        "post": [
            ("post_attn_norm", "post_attention_layernorm"),
            ("post_mlp_norm", "post_feedforward_layernorm"),
        ],
        "sandwich": [
            ("input_norm", "input_layernorm"),
            ("post_attn_norm", "post_attention_layernorm"),
            ("pre_mlp_norm", "pre_feedforward_layernorm"),
            ("post_mlp_norm", "post_feedforward_layernorm"),
        ],
    }[cfg.norm_placement]
    specs += [
        _one(f"{dst}.{ours}.weight", f"{src}.{theirs}.weight", (h,)) for ours, theirs in norms
    ]
    if cfg.is_moe_layer(n):
        block = f"{src}.{naming.moe_block}"
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        specs.append(_one(f"{dst}.mlp.router.weight", f"{block}.gate.weight", (e, h)))
        for x in range(e):
            specs += _mlp(
                f"{dst}.mlp.experts.{x}",
                f"{block}.experts.{x}",
                naming.expert_names,
                h,
                i,
                kind="expert",
            )
        if cfg.shared_expert_intermediate_size:
            specs += _mlp(
                f"{dst}.mlp.shared_expert",
                f"{block}.shared_expert",
                ("gate_proj", "up_proj", "down_proj"),
                h,
                cfg.shared_expert_intermediate_size,
            )
            specs.append(
                _one(
                    f"{dst}.mlp.shared_expert_gate.weight",
                    f"{block}.shared_expert_gate.weight",
                    (1, h),
                )
            )
    else:
        specs += _mlp(
            f"{dst}.mlp",
            f"{src}.mlp",
            ("gate_proj", "up_proj", "down_proj"),
            h,
            cfg.intermediate_size,
            fused=naming.fused_gate_up,
            bias=cfg.mlp_bias,
            lora=True,
        )
    return specs


def weight_layout(cfg: ModelConfig) -> list[WeightSpec]:
    """Every parameter of ``cfg``'s model, in load order (embedding, layers, norm, head)."""
    spec = lookup(cfg.architecture)
    h, v = cfg.hidden_size, cfg.vocab_size
    specs = [_one("embed", "model.embed_tokens.weight", (v, h))]
    for n in range(cfg.num_layers):
        specs += _layer_layout(cfg, spec, n)
    specs.append(_one("norm.weight", "model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        specs.append(_one("lm_head.weight", "lm_head.weight", (v, h), "lm_head"))
    return specs


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor the checkpoint must hold."""
    return {
        name: shape
        for spec in weight_layout(cfg)
        for name, shape in zip(spec.sources, spec.shapes, strict=True)
    }


def lora_layout(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per fused projection LoRA can attach to: input features and each slice's outputs.

    Read from layer 0's entries; a projection that is not in every layer (the dense MLP of
    a mixture-of-experts model) is left out, so adapters may target attention only there.
    """
    per_layer: list[dict[str, tuple[int, tuple[int, ...]]]] = [{} for _ in range(cfg.num_layers)]
    for spec in weight_layout(cfg):
        if spec.lora is not None and spec.layer is not None:
            per_layer[spec.layer][spec.lora[0]] = (spec.shapes[0][1], spec.lora[1])
    common = set(per_layer[0]).intersection(*per_layer[1:]) if per_layer else set()
    return {name: value for name, value in per_layer[0].items() if name in common}
