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
