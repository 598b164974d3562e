"""Shared fixtures: tiny random Hugging Face models of every supported family.

Models are made with transformers' own config classes and ``save_pretrained`` (so the
loader is tested on real files), with a real byte-level BPE tokenizer, once per session.
Weights are re-initialised with a larger spread than transformers' default so logits are
peaked: greedy parity then tests the engine, not fp32 noise on near-ties.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(
    "TOKENMILL_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "tokenmill")
)
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU kernels once before any test, so no server test spends its start-up
    wait compiling them (a fresh clone on a busy machine took longer than the 60 s wait)."""
    from tokenmill.kernels import build

    build.load()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
DENSE_FAMILIES = ["llama_bias", "olmo2", "phi3", "gemma2", "gemma3"]
"""Dense families (registry entries on the shared decoder)."""
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


def random_prompts(vocab: int, num: int, seed: int, max_len: int = 60) -> list[list[int]]:
    """``num`` reproducible prompts of 1 to ``max_len`` token ids, none of them special (< 4)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def _hf_config(family: str, vocab_size: int, **overrides: Any):
    import transformers

    kwargs = {**_BASE, "vocab_size": vocab_size, **overrides}
    if family == "llama":
        return transformers.LlamaConfig(**kwargs)
    if family == "mistral":
        kwargs.setdefault("sliding_window", 24)
        return transformers.MistralConfig(**kwargs)
    if family == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    if family == "qwen3":
        kwargs.setdefault("head_dim", 16)
        return transformers.Qwen3Config(**kwargs)
    if family == "llama_bias":
        return transformers.LlamaConfig(**{"attention_bias": True, "mlp_bias": True, **kwargs})
    if family == "olmo2":
        return transformers.Olmo2Config(**{"pad_token_id": 0, **kwargs})
    if family == "phi3":
        partial = kwargs.pop("partial_rotary_factor", 1.0)
        num_factors = int(kwargs["hidden_size"] // kwargs["num_attention_heads"] * partial) // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(num_factors)],
            "long_factor": [2.0 + 0.5 * i for i in range(num_factors)],
            "original_max_position_embeddings": 128,
        }
        return transformers.Phi3Config(
            **{
                "pad_token_id": 0,
                "rope_parameters": rope,
                "original_max_position_embeddings": 128,
                **kwargs,
            }
        )
    if family in ("gemma2", "gemma3"):
        gemma = {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "pad_token_id": 0,
            "tie_word_embeddings": True,
        }
        if family == "gemma2":
            return transformers.Gemma2Config(**{**gemma, **kwargs})
        gemma["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        }
        return transformers.Gemma3TextConfig(**{**gemma, **kwargs})
    if family == "mixtral":
        moe = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}
        # the experts' defaults over the base shape, the caller's overrides over both
        return transformers.MixtralConfig(**{**kwargs, **moe, **overrides})
    if family == "qwen2_moe":
        moe = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        }
        return transformers.Qwen2MoeConfig(**{**moe, **kwargs})
    if family == "qwen3_moe":
        moe = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 16,
        }
        return transformers.Qwen3MoeConfig(**{**moe, **kwargs})
    raise ValueError(family)


def _reinit(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenmill.model.demo import build_bpe_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_bpe_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def make_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    """``make_model(family, **config_overrides) -> folder``, cached per argument set."""
    import transformers

    cache: dict[tuple, Path] = {}

    def make(
        family: str = "llama", seed: int = 0, dtype: str = "float32", **overrides: Any
    ) -> Path:
        key = (family, seed, dtype, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key in cache:
            return cache[key]
        from tokenmill.tokenizer import Tokenizer

        vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
        config = _hf_config(family, vocab, **overrides)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        _reinit(model, seed)
        model = model.to(getattr(torch, dtype))
        folder = tmp_path_factory.mktemp(f"{family}-model")
        model.save_pretrained(folder)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
        cache[key] = folder
        return folder

    return make


def hf_greedy(
    folder: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Reference: transformers ``generate`` (greedy, EOS ignored), one prompt at a time.

    Returns the generated ids and, per prompt, the raw log-softmax of each step's logits.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    outs, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            res = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            outs.append(res.sequences[0, len(prompt) :].tolist())
            logprobs.append(torch.stack(res.logits, dim=0)[:, 0].float().log_softmax(-1))
    return outs, logprobs


@pytest.fixture(scope="session")
def reference_greedy() -> Callable[..., tuple[list[list[int]], list[torch.Tensor]]]:
    """Memoised ``hf_greedy``: parity tests of one model share the reference run."""
    cache: dict[tuple, tuple[list[list[int]], list[torch.Tensor]]] = {}

    def run(folder: Path, prompts: list[list[int]], max_new_tokens: int):
        key = (str(folder), tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(folder, prompts, max_new_tokens)
        return cache[key]

    return run


ALL_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_adapter(model_folder, seed, **LoraConfig options) -> folder``: a PEFT LoRA with
    random A *and* B (peft starts B at zero, which would make every adapter a no-op)."""
    cache: dict[tuple, Path] = {}

    def make(model_folder: Path, seed: int = 0, **options: Any) -> Path:
        import peft
        import transformers

        key = (str(model_folder), seed, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key in cache:
            return cache[key]
        options = {"r": 8, "lora_alpha": 16, "target_modules": ALL_LORA_TARGETS, **options}
        base = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(**options))
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        folder = tmp_path_factory.mktemp("lora")
        model.save_pretrained(folder)
        cache[key] = folder
        return folder

    return make


def peft_greedy(
    model_folder: Path, adapter_folder: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Reference: transformers + peft ``generate`` with one adapter (greedy, EOS ignored)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_folder)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            res = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(res[0, len(prompt) :].tolist())
    return outs


def anon_rss_bytes() -> int:
    """This process's resident anonymous memory (RssAnon), for memory-behaviour tests."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")
