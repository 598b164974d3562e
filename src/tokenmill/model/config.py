"""ModelConfig: the architecture facts the shared decoder needs, parsed from config.json.

Families (Llama, Mistral, Qwen2, Qwen3) differ only by flags here (qkv bias, q/k norm,
sliding window, RoPE scaling), so one decoder implementation serves them all. Both the
transformers v4 (``rope_theta`` + ``rope_scaling``) and v5 (``rope_parameters``) layouts
are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError


@dataclass(frozen=True)
class FamilySpec:
    """What distinguishes one model family inside the shared decoder."""

    qkv_bias: bool = False
    qk_norm: bool = False
    uses_sliding_window: bool = False


FAMILIES: dict[str, FamilySpec] = {
    "LlamaForCausalLM": FamilySpec(),
    "MistralForCausalLM": FamilySpec(uses_sliding_window=True),
    "Qwen2ForCausalLM": FamilySpec(qkv_bias=True, uses_sliding_window=True),
    "Qwen3ForCausalLM": FamilySpec(qk_norm=True, uses_sliding_window=True),
}


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
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full attention."""
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings and LM head counted separately when untied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * per_layer + v * h + head + h

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in FAMILIES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; supported: {sorted(FAMILIES)}"
            )
        family = FAMILIES[arch]
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            rope = dict(raw.get("rope_parameters") or {})
            rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling = rope or raw.get("rope_scaling") or None
            if scaling is not None:
                scaling = dict(scaling)
                kind = scaling.get("rope_type", scaling.get("type", "default"))
                scaling["rope_type"] = kind
                if kind == "default":
                    scaling = None
                elif kind not in ("linear", "llama3"):
                    raise ModelLoadError(
                        f"{source}: rope scaling type {kind!r} is not supported (supported: linear, llama3)"
                    )
            windows = _sliding_windows(raw, family, num_layers)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias or bool(raw.get("attention_bias", False)),
                qk_norm=family.qk_norm,
                sliding_windows=windows,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: invalid value: {exc}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path}: cannot parse: {exc}") from None
        return cls.from_dict(raw, source=str(path))


def _sliding_windows(
    raw: dict[str, Any], family: FamilySpec, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if not family.uses_sliding_window or not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if "use_sliding_window" in raw:  # Qwen2/3 without layer_types (transformers v4)
        if not raw["use_sliding_window"]:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers
