"""Layer numerics against transformers' own functions where a parity run cannot reach them."""

from __future__ import annotations

import torch

from tokenmill.model.layers import RotaryEmbedding


def test_longrope_uses_short_factors_below_the_original_context_and_long_from_it() -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": 64,
    }
    cfg = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_parameters=rope,
        pad_token_id=0,
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=65)
    ours = RotaryEmbedding(16, 512, 10000.0, {**rope, "max_position_embeddings": 512})
    for position, inv_freq in ((10, short), (63, short), (64, long), (300, long)):
        freqs = position * inv_freq
        want = torch.cat((freqs, freqs)).cos() * factor
        assert torch.allclose(ours.cos[position], want, atol=1e-6), position
    assert factor > 1.0  # 512 / 64 context extension scales the attention


def test_gemma_offset_norm_matches_transformers_in_every_dtype() -> None:
    """Gemma scales by ``1 + weight`` in fp32 before rounding: the CPU kernel (its ``offset``
    flag) as transformers does."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from tokenmill.model.layers import RMSNorm

    torch.manual_seed(0)
    weight = torch.randn(96) * 0.5
    theirs = GemmaRMSNorm(96, eps=1e-6)
    theirs.weight.data.copy_(weight)
    for dtype in (torch.float32, torch.bfloat16):
        ours = RMSNorm(96, 1e-6, offset=True).to(dtype)
        ours.weight.data.copy_(weight.to(dtype))
        x, residual = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
        out, summed = ours(x, residual)
        assert torch.equal(summed, x + residual)
        want = theirs.to(dtype)(x + residual)
        assert torch.allclose(
            out.float(), want.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5
        )
