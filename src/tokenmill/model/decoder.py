"""The shared decoder-only transformer (Llama, Mistral, Qwen2, Qwen3).

Families differ only by ModelConfig flags: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), sliding-window layers (Mistral, Qwen), RoPE scaling (Llama 3). Projections are
fused at load time: one [q|k|v] matmul and one [gate|up] matmul per layer. The forward
takes a flat batch of tokens from many requests; attention reads the paged KV cache. A
step with LoRA rows passes its ``LoRAStepState``, which adds each projection's delta.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.attention import (
    FP8_DTYPES,
    AttentionMetadata,
    DecodeMetadata,
    paged_attention,
    write_kv,
)
from tokenmill.model.config import ModelConfig
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding, silu_and_mul
from tokenmill.model.lora import LoRAStepState


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    """Self-attention with fused QKV, optional q/k norm and an optional sliding window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_windows[layer_idx]
        self.scale = cfg.head_dim**-0.5
        self.layer_idx = layer_idx
        self.register_buffer("kv_scales", torch.ones(2), persistent=False)
        """fp8 caches only: K and V are stored divided by these (set by ``calibrate_kv_scales``)."""
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
        meta: AttentionMetadata | DecodeMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        if lora is not None:
            qkv = lora.apply(self.layer_idx, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        if isinstance(meta, DecodeMetadata):
            out = torch.ops.tokenmill.decode_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                self.window or 0,
                meta.trim_to_longest,
                self.kv_scales,
            )
        else:
            if k_cache.dtype in FP8_DTYPES and not self.kv_scales_calibrated:
                self.calibrate_kv_scales(k, v, k_cache.dtype)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.kv_scales)
            out = paged_attention(
                q, k_cache, v_cache, meta, self.scale, self.window, self.kv_scales
            )
        if lora is None:
            return self.o(out)
        return lora.apply(self.layer_idx, "o", out, self.o(out))


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused [gate|up] projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, lora: LoRAStepState | None = None) -> torch.Tensor:
        if lora is None:
            return self.down(silu_and_mul(self.gate_up(x)))
        h = silu_and_mul(lora.apply(self.layer_idx, "gate_up", x, self.gate_up(x)))
        return lora.apply(self.layer_idx, "down", h, self.down(h))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeMetadata,
        lora: LoRAStepState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rope, kv_cache, meta, lora)
        h, residual = self.post_attn_norm(h, residual)
        return self.mlp(h, lora), residual


class DecoderModel(nn.Module):
    """Embedding, N decoder layers, final norm and LM head."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, rope: RotaryEmbedding | None = None
    ) -> None:
        """``rope`` may come prebuilt: the loader builds the model on the meta device, where
        computing the RoPE tables would only cost seconds of lazy torch imports."""
        super().__init__()
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = (
            rope
            if rope is not None
            else RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | DecodeMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of tokens."""
        x = nn.functional.embedding(input_ids, self.embed)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope, kv_cache, meta, lora)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows that need them."""
        return self.lm_head(hidden).float()

    def linears(self) -> list[Linear]:
        """Every projection, for weight-layout changes such as oneDNN prepacking."""
        return [m for m in self.modules() if isinstance(m, Linear)]
