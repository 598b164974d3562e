"""Tiny random checkpoints of architectures tokenmill does not implement natively, for the
Transformers fallback's tests (built with transformers' own config classes and
``save_pretrained``, with the suite's byte-level BPE tokenizer)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _neox(vocab: int, **overrides: Any) -> Any:
    """GPT-NeoX: parallel residual, fused per-head QKV, rotary on a quarter of each head."""
    import transformers

    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        partial_rotary_factor=0.25,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.GPTNeoXConfig(**{**kwargs, **overrides})


def _gpt2(vocab: int, **overrides: Any) -> Any:
    """GPT-2: LayerNorm, biases everywhere, learned absolute positions, Conv1D, tied head."""
    import transformers

    kwargs = dict(
        vocab_size=vocab,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.GPT2Config(**{**kwargs, **overrides})


def _opt(vocab: int, **overrides: Any) -> Any:
    """OPT: LayerNorm, ReLU MLP, learned positions offset by 2."""
    import transformers

    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return transformers.OPTConfig(**{**kwargs, **overrides})


def _starcoder2(vocab: int, **overrides: Any) -> Any:
    """StarCoder2: LayerNorm with biases, GQA, sliding-window attention, GELU MLP."""
    import transformers

    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        sliding_window=8,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.Starcoder2Config(**{**kwargs, **overrides})


CONFIGS: dict[str, Callable[..., Any]] = {
    "gpt_neox": _neox,
    "gpt2": _gpt2,
    "opt": _opt,
    "starcoder2": _starcoder2,
}


def build_fallback_model(
    folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: Any
) -> Path:
    """Save a random ``arch`` model (peaked weights, so greedy ties are rare) into ``folder``."""
    import transformers

    from tokenmill.tokenizer import Tokenizer

    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](vocab, **overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_scale = p.ndim == 1 and name.endswith("weight")
            p.copy_((1.0 if is_norm_scale else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder
