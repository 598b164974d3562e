"""ModelConfig: the architecture facts the shared decoder needs, parsed from config.json.

Families differ only by flags here (biases, q/k norm, norm placement, sliding windows,
RoPE variants, soft-capping, mixture-of-experts shape); which flags a family sets comes
from ``model/registry.py``. Both the transformers v4 (``rope_theta`` + ``rope_scaling``)
and v5 (``rope_parameters``, per layer type for Gemma 3) layouts are accepted. A value
the decoder cannot honour is refused here, naming the file, the field and what works.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.registry import ArchSpec, lookup, resolve_model_impl, weight_layout
from tokenmill.model.source import is_gguf_file

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
"""RoPE scaling types the rotary embedding implements."""
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""MLP activations the decoder implements."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: str
    """``none``, ``head`` (per-head RMSNorm of q and k) or ``full`` (over all heads)."""
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full attention."""
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_bias: bool = False
    mlp_bias: bool = False
    norm_placement: str = "pre"
    """``pre`` (Llama), ``post`` (OLMo 2: norms of the attention and MLP outputs) or
    ``sandwich`` (Gemma: both)."""
    hidden_act: str = "silu"
    norm_offset: bool = False
    """RMSNorm scales by ``1 + weight`` (Gemma)."""
    embed_scale: float | None = None
    """Embeddings are multiplied by this (Gemma: sqrt(hidden_size))."""
    attn_scale: float | None = None
    """Query scaling; None means head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rotary_dim: int | None = None
    """Leading dims of each head that RoPE rotates (Phi-3 partial_rotary_factor); None: all."""
    local_rope_theta: float | None = None
    """Sliding layers' RoPE base, when it differs from the global one (Gemma 3)."""
    local_rope_scaling: dict[str, Any] | None = None
    moe: str = "none"
    """Router flavour of the sparse layers: ``mixtral``, ``qwen2_moe``, ``qwen3_moe``."""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to one."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's always-on expert (0: none)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: sparse MLP (True) or dense MLP."""
    model_impl: str = "native"
    """``native`` (the shared decoder) or ``transformers`` (``model/transformers_fallback.py``)."""
    declared_num_params: int | None = None
    """Parameter count of a model the registry does not lay out (the Transformers fallback)."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def num_params(self) -> int:
        """Parameter count, from the registry's layout (an untied LM head counted apart)."""
        if self.declared_num_params is not None:
            return self.declared_num_params
        return sum(spec.numel for spec in weight_layout(self))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        spec = lookup(archs[0] if archs else None, source)
        family = spec.family
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            rope_theta, scaling, local_theta, local_scaling, rotary_dim = _rope(
                raw, spec, head_dim, source
            )
            windows = _sliding_windows(raw, spec, num_layers)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
            if family.gemma:
                act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
            if act not in HIDDEN_ACTS:
                field = "hidden_activation" if family.gemma else "hidden_act"
                raise ModelLoadError(
                    f"{source}: {field} {act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})"
                )
            if raw.get("use_bidirectional_attention"):
                raise ModelLoadError(
                    f"{source}: use_bidirectional_attention is true (an encoder/embedding "
                    "checkpoint); tokenmill serves causal decoders only"
                )
            attention_bias = bool(raw.get("attention_bias", False))
            moe = _moe_fields(raw, spec, num_layers, source)
            query_scalar = raw.get("query_pre_attn_scalar") if family.gemma else None
            return cls(
                architecture=spec.name,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw.get("intermediate_size") or 0),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.gemma)),
                qkv_bias=family.qkv_bias or bool(raw.get("qkv_bias", False)) or attention_bias,
                o_bias=attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=family.qk_norm,
                norm_placement=family.norm_placement,
                hidden_act=act,
                norm_offset=family.gemma,
                embed_scale=hidden**0.5 if family.gemma else None,
                attn_scale=float(query_scalar) ** -0.5 if query_scalar else None,
                attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping"))
                if family.gemma
                else None,
                final_logit_softcap=_optional_float(raw.get("final_logit_softcapping"))
                if family.gemma
                else None,
                rotary_dim=rotary_dim,
                local_rope_theta=local_theta,
                local_rope_scaling=local_scaling,
                sliding_windows=windows,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **moe,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: invalid value: {exc}") from None

    @classmethod
    def from_folder(
        cls, folder: str | Path, model_impl: str = "native", hf_config_path: str | None = None
    ) -> ModelConfig:
        """The config of a model folder, for ``--model-impl model_impl`` (see the registry's
        ``resolve_model_impl``); Transformers is imported only for the fallback. With
        ``hf_config_path`` (``--hf-config-path``), that config.json is read instead of the
        folder's own (``config_override``)."""
        if hf_config_path is not None:
            return config_override(Path(folder), hf_config_path, model_impl)
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(not_a_model_folder(Path(folder)))
        raw = _read_config(path)
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        impl, _ = resolve_model_impl(archs[0] if archs else None, model_impl)
        if impl == "transformers":
            from tokenmill.model.transformers_fallback import fallback_model_config

            return fallback_model_config(Path(folder))
        return cls.from_dict(raw, source=str(path))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return raw


def hf_config_file(value: str) -> Path:
    """The config.json ``--hf-config-path value`` names: the file itself, or a folder that
    holds one. Local only: a Hub id is refused, saying so (nothing is downloaded)."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--hf-config-path {value}: the folder has no config.json")
        return path / "config.json"
    if path.is_file():
        return path
    if _HUB_ID.fullmatch(value):
        raise ConfigError(
            f"--hf-config-path {value}: no such local folder or file. This looks like a Hugging "
            "Face Hub id, and tokenmill does not download: fetch its config.json first, then "
            "give that file or its folder"
        )
    raise ConfigError(f"--hf-config-path {value}: no such file or folder")


_SHAPE_FIELDS = (
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("vocab_size", "vocab_size"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"),
    ("num_experts", "num_experts"),
    ("moe_intermediate_size", "moe_intermediate_size"),
)
"""(ModelConfig field, config.json key) of the facts the weights' shapes follow from."""


def config_override(folder: Path, value: str, model_impl: str = "native") -> ModelConfig:
    """The model config from ``--hf-config-path value`` instead of ``folder``'s own (vLLM's
    flag): for a GGUF file, instead of the config its metadata gave.

    It must describe the same weights: where the folder has a config of its own (a GGUF
    file's always does), every field the tensor shapes follow from must agree with it, and
    so must the whole tensor layout the registry derives; a disagreement is one
    ``ConfigError`` naming the field. Without one, the checkpoint check judges it against
    the tensors themselves. Native architectures only: the Transformers fallback reads
    the folder's config.json with Transformers' own loader."""
    path = hf_config_file(value)
    raw = _read_config(path)
    archs = raw.get("architectures") or []
    architecture = archs[0] if archs else None
    impl, _ = resolve_model_impl(architecture, model_impl)
    if impl == "transformers":
        raise ConfigError(
            f"--hf-config-path {value}: {architecture} would run through the Transformers "
            "fallback, which reads the model folder's own config.json; the flag applies to "
            "tokenmill's native architectures"
        )
    cfg = ModelConfig.from_dict(raw, source=str(path))
    own_path = folder / "config.json"
    if not own_path.is_file():
        return cfg
    try:
        own = ModelConfig.from_dict(_read_config(own_path), source=str(own_path))
    except ModelLoadError:
        return cfg  # the folder's own config is not tokenmill's to read: the tensors judge
    for name, key in _SHAPE_FIELDS:
        given, weights = getattr(cfg, name), getattr(own, name)
        if given != weights:
            raise ConfigError(
                f"--hf-config-path {value}: {key} is {given}, but the weights of {folder} "
                f"have {weights} ({own_path}); give a config of this model"
            )
    ours, theirs = _tensor_shapes(cfg), _tensor_shapes(own)
    if ours != theirs:
        name = sorted(set(ours) ^ set(theirs) or {n for n in ours if ours[n] != theirs[n]})[0]
        raise ConfigError(
            f"--hf-config-path {value}: it lays out tensor {name} as "
            f"{list(ours[name]) if name in ours else 'absent'}, but the weights of {folder} "
            f"have {list(theirs[name]) if name in theirs else 'none'} ({own_path}); give a "
            "config of this model"
        )
    return cfg


def _tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {
        name: shape
        for spec in weight_layout(cfg)
        for name, shape in zip(spec.sources, spec.shapes, strict=True)
    }


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _scaling(
    params: dict[str, Any] | None, raw: dict[str, Any], field: str, source: str
) -> dict[str, Any] | None:
    """A RoPE scaling dict with ``rope_type`` set, None for plain RoPE; unknown types refused."""
    if not params:
        return None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("su", "yarn") and "long_factor" in scaling:  # Phi-3's old names for longrope
        kind = "longrope"
    scaling["rope_type"] = kind
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: {field} type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if kind == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
        scaling.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
    return scaling


def _rope(
    raw: dict[str, Any], spec: ArchSpec, head_dim: int, source: str
) -> tuple[float, dict[str, Any] | None, float | None, dict[str, Any] | None, int | None]:
    """(theta, scaling, local theta, local scaling, rotary dim) from either config layout."""
    params = dict(raw.get("rope_parameters") or {})
    local: dict[str, Any] | None = None
    if "full_attention" in params or "sliding_attention" in params:  # v5, per layer type
        local = dict(params.get("sliding_attention") or {})
        params = dict(params.get("full_attention") or {})
    default_theta = 1_000_000.0 if spec.family.rope_per_layer_type else 10000.0
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    scaling = _scaling(params or raw.get("rope_scaling"), raw, field, source)
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor) if factor != 1.0 else None
    if not spec.family.rope_per_layer_type:
        return theta, scaling, None, None, rotary_dim
    if local is not None:
        local_theta = float(local.get("rope_theta", 10000.0))
        local_scaling = _scaling(local, raw, "rope_parameters.sliding_attention", source)
    else:
        local_theta, local_scaling = float(raw.get("rope_local_base_freq", 10000.0)), None
    return theta, scaling, local_theta, local_scaling, rotary_dim


def _moe_fields(
    raw: dict[str, Any], spec: ArchSpec, num_layers: int, source: str
) -> dict[str, Any]:
    kind = spec.family.moe
    if kind == "none":
        return {}
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    top_k = int(raw["num_experts_per_tok"])
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok {top_k} must be between 1 and the number of "
            f"experts ({num_experts})"
        )
    if kind == "mixtral":
        inter, norm_topk, shared, layers = (
            int(raw["intermediate_size"]),
            True,
            0,
            [True] * num_layers,
        )
    else:
        inter = int(raw["moe_intermediate_size"])
        norm_topk = bool(raw.get("norm_topk_prob", kind == "qwen3_moe"))
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        layers = [
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ]
    return {
        "moe": kind,
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm_topk,
        "shared_expert_intermediate_size": shared,
        "moe_layers": tuple(layers),
    }


def _sliding_windows(
    raw: dict[str, Any], spec: ArchSpec, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if not spec.family.uses_sliding_window or not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if not layer_types and spec.name == "Gemma2ForCausalLM":  # transformers' default pattern
        layer_types = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
    if not layer_types and spec.name == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if "use_sliding_window" in raw:  # Qwen2/3 without layer_types (transformers v4)
        if not raw["use_sliding_window"]:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def not_a_model_folder(folder: Path) -> str:
    """Why ``folder`` is not a model folder, telling apart the usual mistakes: a path that
    does not exist, a Hub id (nothing is downloaded), a GGUF file, and a folder without
    ``config.json``, so the one-line start-up error says what to do about each."""
    if not folder.exists():
        if _HUB_ID.fullmatch(str(folder)):
            return (
                f"{folder}: no such local folder. This looks like a Hugging Face Hub id, and "
                "tokenmill does not download models: fetch the folder first (for example "
                f"`huggingface-cli download {folder} --local-dir ./{folder.name}` where the Hub "
                "is reachable), then serve that folder"
            )
        return f"{folder}: no such file or folder"
    if folder.is_file():
        if is_gguf_file(folder):
            return f"{folder} is a GGUF file that could not be opened as a model"
        return f"{folder} is a file; give a model folder (config.json with safetensors weights)"
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if ggufs:
        return (
            f"{folder}: no config.json; the folder holds GGUF files ({', '.join(ggufs[:5])}): "
            f"give one of them (e.g. {folder / ggufs[0]})"
        )
    return f"{folder}: no config.json (is this a Hugging Face model folder?)"
