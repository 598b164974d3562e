"""Building blocks shared by every model family: RMSNorm, rotary embeddings, gated MLPs.

They follow transformers' numerics (fp32 norm statistics, fp32 RoPE tables), in torch or in
tokenmill's CPU kernels (bf16 and fp32 activations alike), so that greedy outputs match
token for token in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill import envs, kernels
from tokenmill.kernels import gemv_layout
from tokenmill.model.opaque_op import opaque_op, register_fake


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@opaque_op("onednn_linear")
def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """A prepacked oneDNN linear as an opaque op, so torch.compile fuses around it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@register_fake("onednn_linear")
def _onednn_linear_fake(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


GEMV_ENV = envs.BF16_GEMV
"""``0`` keeps bf16 and fp32 projections in oneDNN's layout instead of tokenmill's GEMV blocks
(A/B runs; the name predates the fp32 kernel)."""


def gemv_layout_wanted() -> bool:
    """Whether bf16 and fp32 CPU projections should be packed for ``Linear.pack_for_gemv``.

    Yes unless ``TOKENMILL_BF16_GEMV=0``: measured against prepacked oneDNN on the 250M
    model's projections (one thread, interleaved), ``kernels.gemv_bf16`` is 1.3-1.8x faster
    at 1-8 rows, 1.0-1.3x at 16-64 and 0.97-1.28x at 512-2048 (prefill chunks), so one
    layout serves every batch (see avx512.cpp). ``kernels.gemv_f32`` (one thread, weights
    streamed from memory, the demo's and a 250M Llama's shapes): 1.5-2.4x at one row,
    1.1-1.6x at 5, 0.98-1.08x at 64 and 0.91-1.0x at 512: decode and verification steps
    gain far more than a prefill chunk loses, and a second copy of each weight would double
    the memory. On AVX2 (``benchmarks/gemv_ab.py``, 2 threads, AVX2-only EPYC,
    ``results/gemv_ab_avx2.md``): fp32 1.02-2.6x oneDNN from 1 to 512 rows; bf16, which
    oneDNN does not run there (``F.linear`` does), 1.5-1.7x at one row and 4.9-7.8x from 4."""
    return not envs.is_off(GEMV_ENV)


class Linear(nn.Module):
    """``y = x W^T + b``, optionally with the weight prepacked for oneDNN on CPU.

    Prepacking into oneDNN's blocked layout (what inductor's CPU freezing does) makes fp32
    GEMMs at decode batch sizes about 2x faster than the default MKL path on this kind of
    machine (measured: 81 vs 45 GFLOP/s at 32 rows, 2 threads). The plain weight is dropped
    once packed, so memory does not grow.

    bf16 and fp32 with tokenmill's kernels (AVX-512 or AVX2) are stored for
    ``kernels.gemv_bf16`` / ``gemv_f32`` instead (``pack_for_gemv``): 16-channel blocks
    that each thread reads as one sequential stream.
    Row-major and oneDNN-packed weights are read several short rows side by side, and at
    one row that left both at a fraction of a plain sequential read's bandwidth
    (``benchmarks/gemv_bandwidth.py``); the GEMV's register tiles keep up with oneDNN's
    GEMM at prefill sizes too (``gemv_layout_wanted``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None
        self.gemv: torch.Tensor | None = None
        """The bf16 or fp32 weight in ``kernels.gemv_layout``'s blocks (``pack_for_gemv``)."""
        self.in_features, self.out_features = in_features, out_features

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` in float32: a bf16 GEMV keeps its fp32 sums instead of rounding them
        (an LM head's logits, where rounding turns close candidates into ties)."""
        if self.gemv is not None and self.gemv.dtype == torch.bfloat16:
            return kernels.gemv_bf16_f32out(x, self.gemv, self.out_features, self.bias)
        weight = self.weight
        if (
            self.gemv is None
            and self.packed is None
            and weight is not None
            and x.dtype == torch.bfloat16
            and kernels.supports(x)
            and weight.dtype == torch.bfloat16
            and weight.is_contiguous()
        ):  # a tied head: the embedding's rows, read in place
            return kernels.linear_bf16_f32out(x, weight, self.bias)
        return self(x).float()

    def gated(
        self, x: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """``act_and_mul(self(x))`` for an MLP's fused [gate | up] projection in one kernel
        where the weight is in bf16 GEMV blocks (on AMX the activation runs in the GEMM's
        epilogue, and the [rows, 2 x width] product is never stored); None elsewhere, and the
        caller runs the two ops. The same bits either way (``kernels.gemv_bf16_act``)."""
        act = GATED_KERNEL_ACTS.get(act_and_mul)
        if act is None or self.gemv is None or self.gemv.dtype != torch.bfloat16:
            return None
        if x.dtype != torch.bfloat16 or not kernels.supports(x):
            return None
        return kernels.gemv_bf16_act(x, self.gemv, self.out_features, self.bias, act)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight: a tied LM head packed for the GEMV is also the
        embedding table (``gemv_layout.rows``), so the model keeps one copy of it."""
        assert self.gemv is not None, "a plain weight is looked up as the embedding itself"
        return gemv_layout.rows(self.gemv, ids, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None:
            if self.gemv.dtype == torch.float32:
                return kernels.gemv_f32(x, self.gemv, self.out_features, self.bias)
            return kernels.gemv_bf16(x, self.gemv, self.out_features, self.bias)
        if self.packed is not None:
            if torch.compiler.is_compiling():  # inductor cannot lower a prepacked weight itself
                return torch.ops.tokenmill.onednn_linear(
                    x, self.packed, self.bias, self.out_features
                )
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None, "only packing drops the plain weight"
        return nn.functional.linear(x, self.weight, self.bias)

    def pack_for_gemv(self, reuse_storage: bool = False) -> bool:
        """Store a bf16 or fp32 CPU weight in the blocks tokenmill's GEMV streams; True if
        packed.

        With either kernel table (AVX-512 BF16 or AVX2, ``benchmarks/gemv_ab.py``); the plain
        weight is dropped. ``reuse_storage``: nothing else holds the weight (the loader's
        own copy), so the blocks may be written over it (``gemv_layout._blocks``); a weight
        shared with another module (a draft's tied embedding) must not be.
        """
        weight = self.weight
        if (
            weight is None
            or weight.device.type != "cpu"
            or weight.dtype not in (torch.bfloat16, torch.float32)
            or not kernels.available()
        ):
            return False
        if weight.dtype == torch.float32:
            self.gemv = gemv_layout.pack_f32(weight.data, reuse_storage)
        else:
            self.gemv = gemv_layout.pack(weight.data, reuse_storage)
        self.weight = None
        return True

    def pack_for_onednn(self, batch_hint: int = 32) -> bool:
        """Prepack for CPU if oneDNN runs this dtype and agrees with F.linear; True if packed.

        fp32 always; bf16 and fp16 where oneDNN has kernels for them. Measured with one
        thread over 8 layers of the 250M model at one row: prepacked bf16 19.9 ms against
        35.1 ms for F.linear on the plain bf16 weight (and 39.1 ms for prepacked fp32).
        The layout depends on the batch size it is packed for (``batch_hint``): packed for
        one row, bf16 read weights at 18.2 GB/s in an isolated one-row loop over the 250M
        model's layers against 13.0 for 32 rows, but was 23-36% slower at 16-512 rows and
        showed no gain in engine decode steps, so every dtype packs for 32.
        """
        weight = self.weight
        if (
            weight is None
            or weight.device.type != "cpu"
            or weight.dtype not in _ONEDNN_TOLERANCE
            or not _onednn_available()
            or (weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
            or (weight.dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported())
        ):
            return False
        tolerance = _ONEDNN_TOLERANCE[weight.dtype]
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.data, batch_hint)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            probe = probe.to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            want = nn.functional.linear(probe, weight, self.bias)
        except RuntimeError:
            return False
        if not torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance):
            return False
        self.packed = packed
        self.weight = None
        return True


_ONEDNN_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
"""How closely a prepacked product must match F.linear on a probe to be trusted, per dtype."""


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual`` it first adds it and returns the new residual too.

    ``offset`` is Gemma's variant: the scale is ``1 + weight`` and it is applied in fp32
    before casting back (Llama casts first, then scales); tokenmill's kernel takes both
    (its ``offset`` flag), so the fused decode step calls the same op.
    """

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kernels.supports(x, float32=True) and self.weight.dtype == x.dtype:
            return kernels.rms_norm(x, self.weight, self.eps, residual, self.offset)
        if residual is not None:
            x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection."""
    if kernels.supports(gate_up, float32=True):  # tokenmill CPU kernel
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh-approximated GELU, Gemma's ``gelu_pytorch_tanh``) on a fused [gate | up]."""
    if kernels.supports(gate_up, float32=True):  # tokenmill CPU kernel
        return kernels.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


ACT_AND_MUL = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
"""Gated activations by the ``hidden_act`` name in config.json."""

GATED_KERNEL_ACTS: dict[Callable[[torch.Tensor], torch.Tensor], str] = {
    silu_and_mul: "silu",
    gelu_tanh_and_mul: "gelu_tanh",
}
"""The gated activations ``kernels.gemv_bf16_act`` fuses into the [gate | up] projection."""


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, including linear and llama3 context extension (``head_dim``:
    the rotated dims). longrope is built by ``RotaryEmbedding`` from two of these."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _longrope_tables(
    rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3's longrope: short factors below the original context, long factors from it on.

    Each position uses the factors of its own range, so the KV cache never has to be
    recomputed. transformers instead recomputes the whole sequence with the long factors
    once it grows past the original context (and vLLM switches a whole batch), so outputs
    agree with transformers exactly while a sequence stays within
    ``original_max_position_embeddings`` (4096 for Phi-3-mini-128k) and drift beyond it.
    """
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings") or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        inv_freq = 1.0 / (ext * theta**exponents)
        freqs = positions[:, None] * inv_freq[None, :]
        tables.append(torch.cat((freqs, freqs), dim=-1))
    is_long = (positions >= original)[:, None]
    emb = torch.where(is_long, tables[1], tables[0])
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half layout).

    ``rotary_dim`` below ``head_dim`` rotates only the leading dims of each head (Phi-3's
    ``partial_rotary_factor``).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        if scaling is not None and scaling["rope_type"] == "longrope":
            cos, sin = _longrope_tables(self.rotary_dim, max_positions, theta, scaling)
        else:
            inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.is_partial = self.rotary_dim != head_dim

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions [T]."""
        if (
            kernels.supports(q, float32=True)
            and self.cos.device.type == "cpu"
            and not self.is_partial
        ):
            return kernels.rope(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        if self.is_partial:
            r = self.rotary_dim
            q_rot, k_rot = q[..., :r], k[..., :r]
            q_rot = q_rot * cos + _rotate_half(q_rot) * sin
            k_rot = k_rot * cos + _rotate_half(k_rot) * sin
            return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
