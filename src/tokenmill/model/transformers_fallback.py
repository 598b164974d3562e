"""The Transformers fallback: any causal LM Transformers can load, over tokenmill's KV cache.

Transformers' own modeling code runs the model (embeddings, norms, MLPs, RoPE, the head),
while tokenmill keeps its scheduler, paged or static KV cache, prefix caching and sampler.
The seam is Transformers' attention-interface registry: the model is loaded with
``attn_implementation="tokenmill"``, so every attention module hands its q/k/v (RoPE
applied) to ``_attention`` here, which writes K/V into that layer's cache and attends
through the model's ``AttentionBackend`` with the step's metadata. The metadata travels as
a keyword argument (``tokenmill_step``, a ``StepContext``) that Transformers passes down
to attention, never in a global. The step's ragged batch is one row of ``[1, T]`` tokens
with tokenmill's positions; Transformers keeps no cache and builds no mask.

vLLM's and SGLang's Transformers backends plug in the same way. A model is refused at
start-up, with the reason, when its attention cannot be expressed so: encoder-decoders,
stateful (recurrent, state-space) layers, layer types other than full or sliding
attention, batch-dependent RoPE, modeling code that does not route attention through the
interface, and, as the last check, a model whose logits on a probe (two ragged sequences
prefilled together, then one decode step each) differ from Transformers' own eager run.

Imported only when a model runs through the fallback: native families never import
Transformers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.attention_backend import (
    AttentionBackend,
    BatchGroup,
    StepBatch,
    StepMetadata,
    default_attention_backend,
)
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.lora import LoRAStepState

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "tokenmill"
"""The name tokenmill's attention is registered under in Transformers' AttentionInterface."""
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``config.layer_types`` values the block-table KV cache can hold."""
STATEFUL_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding"})
"""Layer types whose cache is a per-sequence recurrent state, not K/V. Transformers 5.25
dropped the classes' ``_is_stateful`` flag and names Mamba's layers "linear_attention"
(older configs: "mamba"), so both signs are read."""
UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "sinks", "position_bias", "alibi")
"""Attention inputs tokenmill's backends do not implement (attention sinks, ALiBi biases)."""
FEATURES = (
    "supported: paged and static KV cache (static decodes eagerly), prefix caching, chunked "
    "prefill, preemption, fp8 KV cache, beam search, structured outputs, prompt logprobs; "
    "not supported: --quantization, --enable-lora, the compiled decode step"
)
"""What the fallback supports, as stated in errors, the log and docs/architecture.md."""
PROBE_RTOL = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest probe logit difference from Transformers' eager run, relative to the largest
logit; half precision allows ``PROBE_RTOL_HALF``. A wrong position, mask or bias moves
logits by their own magnitude, far beyond either."""
PROBE_RTOL_HALF = 0.1


class FallbackUnsupported(Exception):
    """A model's attention cannot run through tokenmill's backend; the message says why."""


def check_features(quantization: str | None, enable_lora: bool) -> None:
    """Refuse, in one line, the engine features the fallback does not have."""
    if quantization is not None:
        raise ConfigError(
            f"--quantization {quantization}: the Transformers fallback runs Transformers' own "
            f"layers, which tokenmill does not quantize ({FEATURES})"
        )
    if enable_lora:
        raise ConfigError(
            "--enable-lora: the Transformers fallback does not apply LoRA adapters to "
            f"Transformers' layers ({FEATURES})"
        )


# ---- the attention implementation -------------------------------------------------------


class _LayerState:
    """One layer's facts for the backend (``AttentionLayerState``), set from each call."""

    def __init__(self, layer_idx: int, device: torch.device) -> None:
        self.layer_idx = layer_idx
        self.scale = 1.0
        self.window: int | None = None
        self.logit_softcap: float | None = None
        self.kv_scales = torch.ones(2, device=device)
        self.kv_scales_calibrated = False

    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        """fp8 scales from the first K/V written, as the native decoder sets them."""
        limit = torch.finfo(dtype).max / 4
        amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
        self.kv_scales.copy_((amax / limit).clamp(min=1e-8))
        self.kv_scales_calibrated = True


@dataclass
class StepContext:
    """One forward's attention state, passed to every attention call as ``tokenmill_step``."""

    meta: StepMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    layers: list[_LayerState]
    attended: list[int] = field(default_factory=list)
    """Layer indices in the order they attended (the probe checks one call per layer)."""


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention signature over tokenmill's cache: q [1, Hq, T, D], k/v
    [1, Hkv, T, D] in, [1, T, Hq, D] out."""
    name = type(module).__name__
    step = kwargs.get("tokenmill_step")
    if not isinstance(step, StepContext):
        raise FallbackUnsupported(
            f"{name} is called without the step's metadata: the modeling code does not pass "
            "keyword arguments through to attention"
        )
    unsupported = [n for n in UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(n) is not None]
    if unsupported:
        raise FallbackUnsupported(
            f"{name} passes {unsupported} to attention (attention sinks or positional biases), "
            "which tokenmill's attention backend does not implement"
        )
    if attention_mask is not None:
        raise FallbackUnsupported(f"{name} builds its own attention mask")
    if not getattr(module, "is_causal", True) or key.shape[2] != query.shape[2]:
        raise FallbackUnsupported(f"{name} is not causal self-attention")
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(step.layers):
        raise FallbackUnsupported(f"{name} has layer_idx {layer_idx!r}, not a decoder layer")
    kv_cache = step.kv_caches[layer_idx]
    if tuple(key.shape[1::2]) != (kv_cache[0].shape[2], kv_cache[0].shape[3]):
        raise FallbackUnsupported(
            f"layer {layer_idx} attends with {key.shape[1]} KV heads of size {key.shape[3]}, "
            f"but config.json gives {kv_cache[0].shape[2]} of size {kv_cache[0].shape[3]}"
        )
    layer = step.layers[layer_idx]
    layer.scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.window = kwargs.get("sliding_window") or None
    layer.logit_softcap = kwargs.get("softcap") or None
    step.attended.append(layer_idx)
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = step.backend.forward(layer, q, k, v, kv_cache, step.meta)
    return out.view(1, q.shape[0], q.shape[1], -1), None


def register_attention() -> None:
    """Make ``attn_implementation="tokenmill"`` known to Transformers (idempotent)."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


# ---- the model --------------------------------------------------------------------------


@dataclass
class _HiddenOutput(BaseModelOutputWithPastAndCrossAttentions):
    """A base model's output holding only the last hidden state; any other field a head
    reads (cache, attentions, router logits) is None."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _HiddenStates(nn.Module):
    """Stands in for the decoder inside the Transformers model: ``inputs_embeds`` come back as
    the last hidden state, so the model's own head (with any logit scaling or soft-capping)
    runs on the rows tokenmill asks logits for. A head that reaches into the decoder's
    children (OPT calls ``self.model.decoder``) finds this stand-in there too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        return _HiddenOutput(last_hidden_state=inputs_embeds)


class TransformersCausalLM(CausalLM):
    """A Transformers causal LM behind tokenmill's ``CausalLM`` contract."""

    supports_compiled_decode = False
    eager_reason = "Transformers' modeling code runs eagerly (the fallback has no compiled step)"

    def __init__(
        self, hf_model: nn.Module, cfg: ModelConfig, attn_backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.config = cfg
        self.attn_backend = attn_backend
        prefix = getattr(hf_model, "base_model_prefix", "")
        decoder = getattr(hf_model, prefix, None) if prefix else None
        if not isinstance(decoder, nn.Module):
            raise FallbackUnsupported(
                f"{type(hf_model).__name__} has no base model under {prefix!r} to run apart from its head"
            )
        self.decoder = decoder
        setattr(hf_model, prefix, _HiddenStates())
        self.head = hf_model
        """The Transformers model minus its decoder: embeddings-in, logits-out."""
        device = next(decoder.parameters()).device
        self.layer_states = [_LayerState(i, device) for i in range(cfg.num_layers)]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, StepContext]:
        """Hidden states [T, hidden] and the step's attention record."""
        step = StepContext(meta, kv_caches, self.attn_backend, self.layer_states)
        out = self.decoder(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            tokenmill_step=step,
        )
        hidden: torch.Tensor = out[0][0]
        return hidden, step

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        if lora is not None:
            raise ConfigError(f"the Transformers fallback has no LoRA ({FEATURES})")
        return self.run(input_ids, positions, kv_caches, meta)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(inputs_embeds=hidden[None], use_cache=False).logits[0]
        return logits.float()


# ---- start-up: config, checks, load, probe -------------------------------------------------


def _refuse(folder: Path, architecture: str | None, reason: str) -> ModelLoadError:
    return ModelLoadError(
        f"{folder}: {architecture} cannot run through the Transformers fallback: {reason}"
    )


def _hf_config(folder: Path) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"{folder}/config.json: Transformers cannot read it: {message}"
        ) from None


def _rope_types(value: Any) -> set[str]:
    """Every ``rope_type`` in a (possibly per-layer-type) RoPE parameters dict."""
    if not isinstance(value, dict):
        return set()
    found = {str(value.get("rope_type", value.get("type")))} - {"None"}
    for item in value.values():
        found |= _rope_types(item)
    return found


def _check_structure(folder: Path, hf_config: Any) -> Any:
    """The Transformers causal-LM class for ``hf_config``, or the reason it cannot run here."""
    arch = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
    if getattr(hf_config, "is_encoder_decoder", False):
        raise _refuse(folder, arch, "it is an encoder-decoder; tokenmill runs decoder-only LMs")
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if cls is None:
        raise _refuse(
            folder,
            arch,
            f"Transformers has no causal-LM class for model_type {hf_config.model_type!r}",
        )
    if arch != cls.__name__:
        raise _refuse(
            folder,
            arch,
            f"config.json's model_type {hf_config.model_type!r} is Transformers' "
            f"{cls.__name__}, not the architecture it names",
        )
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if getattr(cls, "_is_stateful", False) or layer_types & STATEFUL_LAYER_TYPES:
        raise _refuse(
            folder,
            arch,
            "it has recurrent or state-space layers, whose per-sequence state is not K/V "
            "that tokenmill's block-table cache can hold",
        )
    if layer_types - set(SUPPORTED_LAYER_TYPES):
        raise _refuse(
            folder,
            arch,
            f"config.json layer_types has {sorted(layer_types - set(SUPPORTED_LAYER_TYPES))}; "
            f"the KV cache holds only {', '.join(SUPPORTED_LAYER_TYPES)} layers",
        )
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if "dynamic" in _rope_types(rope):
        raise _refuse(
            folder,
            arch,
            "dynamic NTK RoPE rescales by the longest position in the forward, which would "
            "tie each request's RoPE to the others in the batch",
        )
    if not getattr(cls, "_supports_attention_backend", False):
        raise _refuse(
            folder,
            arch,
            f"Transformers' {cls.__name__} does not route attention through its attention "
            "interface with keyword arguments passed down (_supports_attention_backend is False)",
        )
    return cls


def fallback_model_config(folder: Path) -> ModelConfig:
    """The KV-sizing facts of a model run by the fallback, from Transformers' config class.

    Refuses models whose structure cannot run here (``_check_structure``).
    """
    hf_config = _hf_config(folder)
    cls = _check_structure(folder, hf_config)
    try:
        num_heads = int(hf_config.num_attention_heads)
        hidden = int(hf_config.hidden_size)
        head_dim = int(getattr(hf_config, "head_dim", None) or hidden // num_heads)
        num_layers = int(hf_config.num_hidden_layers)
        vocab = int(hf_config.vocab_size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{folder}/config.json: missing or invalid field: {exc}") from None
    with torch.device("meta"):
        num_params = sum(p.numel() for p in cls._from_config(hf_config).parameters())
    eos = getattr(hf_config, "eos_token_id", None)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return ModelConfig(
        architecture=(hf_config.architectures or [cls.__name__])[0],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(getattr(hf_config, "intermediate_size", None) or 0),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        rms_norm_eps=0.0,
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm="none",
        sliding_windows=(None,) * num_layers,
        torch_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        model_impl="transformers",
        declared_num_params=num_params,
    )


def load_transformers_model(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    attn_backend: AttentionBackend | None = None,
) -> TransformersCausalLM:
    """Load ``folder`` with Transformers, attach tokenmill's attention and probe it."""
    if max_positions > cfg.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {max_positions}: beyond {cfg.architecture}'s "
            f"max_position_embeddings ({cfg.max_position_embeddings}), which Transformers' "
            "code may not extrapolate to (learned positions); use at most that"
        )
    register_attention()
    try:
        hf_model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _refuse(folder, cfg.architecture, f"Transformers cannot load it: {message}") from None
    hf_model.to(device).eval()
    backend = attn_backend or default_attention_backend(device)
    with torch.inference_mode():
        reference = _reference_logits(hf_model, _probe_sequences(cfg.vocab_size, device))
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        try:
            model = TransformersCausalLM(hf_model, cfg, backend)
            _probe(model, reference, dtype, device)
        except FallbackUnsupported as exc:
            raise _refuse(folder, cfg.architecture, str(exc)) from None
    logger.info(
        "Transformers fallback: %s runs Transformers' %s with tokenmill's %s attention (%s)",
        cfg.architecture,
        type(hf_model).__name__,
        backend.name,
        FEATURES,
    )
    return model


def _probe_sequences(vocab_size: int, device: torch.device) -> list[torch.Tensor]:
    """Two prompts of different lengths; each one's last token is the probe's decode step."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=gen).to(device) for n in (3, 6)]


def _reference_logits(hf_model: nn.Module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Transformers' own logits for each sequence alone, with its eager attention."""
    hf_model.set_attn_implementation("eager")  # type: ignore[operator]
    return [hf_model(input_ids=s[None], use_cache=False).logits[0].float() for s in sequences]


def _probe(
    model: TransformersCausalLM,
    reference: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Prefill both sequences as one ragged batch, then decode one token each, through the
    real backend into a scratch cache; every logit must match ``reference``."""
    cfg = model.config
    block_size = 4
    shape = (4, block_size, cfg.num_kv_heads, cfg.head_dim)  # blocks: a=[0], b=[1, 2]; spare 3
    caches = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    a, b = (s.tolist() for s in _probe_sequences(cfg.vocab_size, device))
    tables = [[0], [1, 2]]

    def slot(seq: int, pos: int) -> int:
        return tables[seq][pos // block_size] * block_size + pos % block_size

    steps = [  # (tokens, positions, slots, group)
        (
            a[:-1] + b[:-1],
            [*range(len(a) - 1), *range(len(b) - 1)],
            [slot(0, p) for p in range(len(a) - 1)] + [slot(1, p) for p in range(len(b) - 1)],
            BatchGroup(
                False,
                [list(range(len(a) - 1)), list(range(len(a) - 1, len(a) + len(b) - 2))],
                [list(range(len(a) - 1)), list(range(len(b) - 1))],
                tables,
                [len(a) - 1, len(b) - 1],
            ),
        ),
        (
            [a[-1], b[-1]],
            [len(a) - 1, len(b) - 1],
            [slot(0, len(a) - 1), slot(1, len(b) - 1)],
            BatchGroup(True, [[0], [1]], [[len(a) - 1], [len(b) - 1]], tables, [len(a), len(b)]),
        ),
    ]
    logits = []
    for tokens, positions, slots, group in steps:
        meta = model.attn_backend.build_metadata(StepBatch(slots, [group], len(tokens)))
        ids = torch.tensor(tokens, device=device)
        try:
            hidden, step = model.run(ids, torch.tensor(positions, device=device), caches, meta)
            logits.append(model.compute_logits(hidden))
        except FallbackUnsupported:
            raise
        except Exception as exc:  # whatever Transformers' code raises on a ragged batch
            raise FallbackUnsupported(
                f"the probe step failed: {type(exc).__name__}: {exc}"
            ) from exc
        if sorted(step.attended) != list(range(cfg.num_layers)):
            raise FallbackUnsupported(
                f"its {cfg.num_layers} layers attended as {sorted(step.attended)} in one step; "
                "the fallback needs exactly one attention call per layer"
            )
    first, second = logits
    na, nb = len(a) - 1, len(b) - 1
    ours = [torch.cat([first[:na], second[:1]]), torch.cat([first[na : na + nb], second[1:]])]
    rtol = PROBE_RTOL.get(dtype, PROBE_RTOL_HALF)
    for got, want in zip(ours, reference, strict=True):
        if got.shape != want.shape:
            raise FallbackUnsupported(
                f"its logits have shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            )
        diff = (got - want).abs().max().item()
        bound = rtol * max(1.0, want.abs().max().item())
        if not diff <= bound:
            raise FallbackUnsupported(
                f"on a probe batch its logits differ from Transformers' eager run by {diff:.3g} "
                f"(allowed {bound:.3g}): its attention needs more than positions and the KV cache"
            )
