"""The shared decoder-only transformer behind every native family (model/registry.py).

Families differ only by ModelConfig flags: q/k/v and o biases, MLP biases, q/k RMSNorm
per head (Qwen3, Gemma 3) or over all heads (OLMo 2), norm placement (pre, post, Gemma's
sandwich), sliding-window layers, RoPE variants and per-layer bases, soft-capping, scaled
embeddings, and a sparse MLP (model/moe.py) in place of the dense one. Projections are
fused at load time: one [q|k|v] matmul and one [gate|up] matmul per layer. The forward
takes a flat batch of tokens from many requests; attention and the KV cache go through
the model's attention backend. A step with LoRA rows passes its ``LoRAStepState``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.model import fused_decode
from tokenmill.model.attention import AttentionMetadata, decode_only_group
from tokenmill.model.attention_backend import (
    AttentionBackend,
    StepMetadata,
    default_attention_backend,
)
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.layers import ACT_AND_MUL, Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.lora import LoRAStepState
from tokenmill.model.quant import Int8Linear
from tokenmill.model.quant_base import prompt_chunks


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    """Self-attention with fused QKV, optional q/k norm, window and soft-cap."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        q_dim, k_dim = (
            (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (cfg.q_size, cfg.kv_size)
        )
        has_norm = cfg.qk_norm != "none"
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, cfg.norm_offset) if has_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, cfg.norm_offset) if has_norm else None
        self.window = cfg.sliding_windows[layer_idx]
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.logit_softcap = cfg.attn_logit_softcap
        self.layer_idx = layer_idx
        self.backend = backend
        self.register_buffer("kv_scales", torch.ones(2), persistent=False)
        """fp8 caches only: K and V are stored divided by these (set by ``calibrate_kv_scales``)."""
        self.kv_scales_calibrated = False

    def reset_state(self, device: torch.device) -> None:
        """Fresh, uncalibrated KV scales on ``device`` (the loader builds on the meta device)."""
        self.kv_scales = torch.ones(2, device=device)
        self.kv_scales_calibrated = False

    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        """Per-tensor fp8 scales from the first K/V written: their largest magnitude maps to a
        quarter of the format's range, leaving room for larger values in later prompts
        (anything beyond saturates)."""
        limit = torch.finfo(dtype).max / 4
        amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
        self.kv_scales.copy_((amax / limit).clamp(min=1e-8))
        self.kv_scales_calibrated = True

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        if lora is not None:
            qkv = lora.apply(self.layer_idx, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full" and self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        out = self.backend.forward_rope(self, positions, rope, q, k, v, kv_cache, meta)
        if lora is None:
            return self.o(out)
        return lora.apply(self.layer_idx, "o", out, self.o(out))


class MLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) with a fused [gate|up] projection."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int = 0,
        intermediate_size: int | None = None,
        bias: bool | None = None,
    ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        has_bias = cfg.mlp_bias if bias is None else bias
        self.gate_up = Linear(cfg.hidden_size, 2 * inter, bias=has_bias)
        self.down = Linear(inter, cfg.hidden_size, bias=has_bias)
        self.act_and_mul = ACT_AND_MUL[cfg.hidden_act]
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, lora: LoRAStepState | None = None) -> torch.Tensor:
        if lora is None:
            gated = self.gate_up.gated(x, self.act_and_mul)
            return self.down(self.act_and_mul(self.gate_up(x)) if gated is None else gated)
        h = self.act_and_mul(lora.apply(self.layer_idx, "gate_up", x, self.gate_up(x)))
        return lora.apply(self.layer_idx, "down", h, self.down(h))


class DecoderLayer(nn.Module):
    """One block. The running hidden state is ``x + residual`` (residual None: just x), so
    the residual add fuses into the next RMSNorm whatever the norm placement."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        eps, offset, h = cfg.rms_norm_eps, cfg.norm_offset, cfg.hidden_size
        self.placement = cfg.norm_placement
        self.input_norm = RMSNorm(h, eps, offset) if self.placement != "post" else None
        self.attn = Attention(cfg, layer_idx, backend)
        self.post_attn_norm = RMSNorm(h, eps, offset)
        self.pre_mlp_norm = RMSNorm(h, eps, offset) if self.placement == "sandwich" else None
        self.post_mlp_norm = RMSNorm(h, eps, offset) if self.placement != "pre" else None
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_idx):
            from tokenmill.model.moe import SparseMoE

            self.mlp = SparseMoE(cfg, layer_idx)
        else:
            self.mlp = MLP(cfg, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        lora: LoRAStepState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.placement == "post":  # OLMo 2: x + norm(attn(x)), then + norm(mlp(.))
            hidden = x if residual is None else x + residual
            attn, _ = self.post_attn_norm(self.attn(hidden, positions, rope, kv_cache, meta, lora))
            hidden = hidden + attn
            out, _ = self.post_mlp_norm(self.mlp(hidden, lora))  # type: ignore[misc]
            return out, hidden
        assert self.input_norm is not None
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rope, kv_cache, meta, lora)
        if self.pre_mlp_norm is None:  # pre-norm (Llama)
            h, residual = self.post_attn_norm(h, residual)
            return self.mlp(h, lora), residual
        h, _ = self.post_attn_norm(h)  # Gemma's sandwich
        h, residual = self.pre_mlp_norm(h, residual)
        out, _ = self.post_mlp_norm(self.mlp(h, lora))  # type: ignore[misc]
        return out, residual


class DecoderModel(CausalLM):
    """Embedding, N decoder layers, final norm and LM head."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        rope: RotaryEmbedding | None = None,
        attn_backend: AttentionBackend | None = None,
        local_rope: RotaryEmbedding | None = None,
    ) -> None:
        """``rope`` (and ``local_rope``) may come prebuilt: the loader builds the model on
        the meta device, where computing the RoPE tables would only cost seconds of lazy
        torch imports."""
        super().__init__()
        self.config = cfg
        self.attn_backend = attn_backend or default_attention_backend(torch.device("cpu"))
        self.supports_compiled_decode = not cfg.is_moe  # routing is data-dependent
        self.embed: nn.Parameter | None = _param(cfg.vocab_size, cfg.hidden_size)
        """None when a tied head was quantized or packed for the GEMV: its rows are the table
        (``Int8Linear.embedding``, ``Linear.embedding``)."""
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.attn_backend) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = rope if rope is not None else build_rope(cfg, max_positions)
        self.local_rope = local_rope
        """Sliding layers' RoPE when their base differs (Gemma 3); else they share ``rope``."""
        if local_rope is None and cfg.local_rope_theta is not None:
            self.local_rope = build_rope(cfg, max_positions, local=True)
        self.runs_fused_decode = True
        """Until a step runner chooses (``worker/step_runner.py``): wherever the encoded layers
        apply (each step still checks the ISA, dtypes and fp8 scales they were encoded for)."""
        self._fused: dict[tuple[str, torch.dtype], fused_decode.FusedLayers | None] = {}
        """The layers encoded for ``fused_decode`` per (ISA, activation dtype); None: they
        cannot be. Built at the first decode step, dropped when the tensors move."""

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> DecoderModel:
        self._fused = {}  # the encoded tensors may be stale now
        return super()._apply(fn, recurse)

    def fused_decode_refusal(self, dtype: torch.dtype) -> str | None:
        if not self.attn_backend.runs_decoder_layers:
            return f"attention backend {self.attn_backend.name} attends its own way"
        if self.rope.is_partial:
            return "partial RoPE"
        if self.rope.cos.device.type != "cpu":
            return f"the model is on {self.rope.cos.device.type}"
        return fused_decode.refusal(self.layers, dtype, self.local_rope)

    def _fused_layers(
        self, x: torch.Tensor, k_cache: torch.Tensor
    ) -> fused_decode.FusedLayers | None:
        """The encoded layers if this decode step can run them in one call, else None."""
        if (
            not self.runs_fused_decode
            or not fused_decode.enabled()
            or torch.compiler.is_compiling()
        ):
            return None
        key = (kernels.active_isa(), x.dtype)
        if key not in self._fused:
            self._fused[key] = fused_decode.encode(self.layers, x.dtype, self.local_rope)
        fused = self._fused[key]
        return fused if fused is not None and fused.applies(x, k_cache) else None

    def _layer_rope(self, layer: nn.Module) -> RotaryEmbedding:
        if self.local_rope is not None and isinstance(layer, DecoderLayer) and layer.attn.window:
            return self.local_rope
        return self.rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of tokens."""
        if self.embed is not None:
            x = nn.functional.embedding(input_ids, self.embed)
        else:  # a tied head, quantized or packed for the GEMV, is the table
            assert isinstance(self.lm_head, (Int8Linear, Linear))
            x = self.lm_head.embedding(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        group = decode_only_group(meta, len(input_ids)) if lora is None else None
        fused = None if group is None else self._fused_layers(x, kv_caches[0][0])
        if fused is not None and group is not None:
            assert isinstance(meta, AttentionMetadata)
            out, summed = fused_decode.run(
                fused,
                x,
                positions,
                self.rope.cos,
                self.rope.sin,
                meta.slot_mapping,
                group.block_tables,
                group.context_lens,
                kv_caches,
            )
            x, _ = self.norm(out, summed)
            return x
        chunks = (
            not torch.compiler.is_compiling()  # the compiled steps decode only; no context there
            and isinstance(meta, AttentionMetadata)
            and any(not g.is_decode for g in meta.groups)
        )
        if chunks:
            with prompt_chunks(True):
                x, residual = self._layers(x, positions, kv_caches, meta, lora)
        else:
            x, residual = self._layers(x, positions, kv_caches, meta, lora)
        x, _ = self.norm(x, residual)
        return x

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        lora: LoRAStepState | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers one by one: (x, residual) for the final norm."""
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            rope = self._layer_rope(layer)
            x, residual = layer(x, residual, positions, rope, kv_cache, meta, lora)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows that need them (soft-capped where the model says)."""
        head = self.lm_head
        forward_float32 = getattr(head, "forward_float32", None)
        if forward_float32 is not None:  # a float or quantized head: fp32 sums kept
            logits = forward_float32(hidden)
        else:  # an adapted head (LoRA)
            logits = head(hidden).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def linears(self) -> list[Linear]:
        """Every projection, for weight-layout changes such as oneDNN prepacking."""
        return [m for m in self.modules() if isinstance(m, Linear)]

    def debug_stats(self) -> dict[str, list[list[int]]]:
        """Tokens routed per sparse layer and expert; empty for a dense model."""
        if not self.config.is_moe:
            return {}
        from tokenmill.model.moe import SparseMoE

        counts = [
            layer.mlp.tokens_per_expert.tolist()
            for layer in self.layers
            if isinstance(layer, DecoderLayer) and isinstance(layer.mlp, SparseMoE)
        ]
        return {"moe_tokens_per_expert": counts}


def build_rope(cfg: ModelConfig, max_positions: int, local: bool = False) -> RotaryEmbedding:
    """The global RoPE of ``cfg`` or, with ``local``, its sliding layers' own."""
    if local:
        theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        return RotaryEmbedding(
            cfg.head_dim, max_positions, theta, cfg.local_rope_scaling, cfg.rotary_dim
        )
    return RotaryEmbedding(
        cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
    )
