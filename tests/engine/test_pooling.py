"""Pooling requests (``runner="pooling"``): embeddings equal a transformers computation on the same weights.

The reference is transformers' base model (``AutoModel``: the decoder without its LM head)
with sentence-transformers' pooling written out: last token or mean over the prompt, then
L2 normalisation. Prompts are batched and chunked through the engine's scheduler.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.entrypoints.llm import LLM
from tokenmill.pooling_params import PoolerConfig, PoolingParams

ATOL = 1e-4


def _prompts(vocab: int, num: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def reference_embeddings(
    folder: Path, prompts: list[list[int]], pooling: str, normalize: bool = True
) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            vector = hidden[-1] if pooling == "LAST" else hidden.mean(0)
            out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return out


def with_sentence_transformers_config(folder: Path, tmp_path: Path, mode: str) -> Path:
    """A copy of ``folder`` declaring its pooling the way Qwen3-Embedding does."""
    target = tmp_path / f"st-{mode}"
    shutil.copytree(folder, target)
    (target / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": mode == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": mode == "last",
            }
        )
    )
    return target


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_last_token_embeddings_match_transformers(make_model, max_num_batched_tokens: int) -> None:
    folder = make_model("qwen3")
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        runner="pooling",
        max_num_batched_tokens=max_num_batched_tokens,
    )
    prompts = _prompts(llm.tokenizer.vocab_size, 12, seed=3)
    got = llm.embed(prompts)
    want = reference_embeddings(folder, prompts, "LAST")
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g), w, atol=ATOL), (torch.tensor(g) - w).abs().max()


def test_mean_pooling_from_sentence_transformers_config(make_model, tmp_path: Path) -> None:
    folder = with_sentence_transformers_config(make_model("llama"), tmp_path, "mean")
    assert PoolerConfig.from_folder(folder).pooling_type == "MEAN"
    llm = LLM(
        str(folder), dtype="float32", max_model_len=128, convert="embed", max_num_batched_tokens=9
    )
    prompts = _prompts(llm.tokenizer.vocab_size, 6, seed=4)
    # The same prompt twice: a prefix-cache hit must not skip positions the mean reads.
    prompts.append(list(prompts[0]))
    got = llm.embed(prompts)
    want = reference_embeddings(folder, prompts, "MEAN")
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g), w, atol=ATOL), (torch.tensor(g) - w).abs().max()


def test_dimensions_truncate_before_normalising(make_model) -> None:
    folder = make_model("qwen3")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, runner="pooling")
    prompt = _prompts(llm.tokenizer.vocab_size, 1, seed=5)[0]
    full = llm.embed([prompt], PoolingParams(normalize=False))[0]
    cut = llm.embed([prompt], PoolingParams(dimensions=16))[0]
    want = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    assert len(cut) == 16
    assert torch.allclose(torch.tensor(cut), want, atol=1e-6)


def test_generation_engine_refuses_embed(make_model) -> None:
    llm = LLM(str(make_model("qwen3")), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="runner"):
        llm.embed(["hello"])


def test_unsupported_sentence_transformers_pooling_is_a_config_error(
    make_model, tmp_path: Path
) -> None:
    folder = with_sentence_transformers_config(make_model("llama"), tmp_path, "last")
    config_path = folder / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(pooling_mode_lasttoken=False, pooling_mode_max_tokens=True)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        PoolerConfig.from_folder(folder)


def test_runner_and_convert_flags_are_checked() -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.errors import ConfigError

    assert EngineConfig(runner="pooling").is_pooling and EngineConfig(convert="embed").is_pooling
    assert not EngineConfig().is_pooling
    with pytest.raises(ConfigError, match="--runner pooling"):
        EngineConfig(convert="embed", runner="generate")
    with pytest.raises(ConfigError, match="--convert none"):
        EngineConfig(convert="none", runner="pooling")
    with pytest.raises(ConfigError, match="--runner 'draft'"):
        EngineConfig(runner="draft")  # type: ignore[arg-type]


def test_matryoshka_dimensions_rules(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 16]}))
    config = PoolerConfig.from_folder(tmp_path)
    assert config.matryoshka_dimensions == (16, 32) and config.pooling_type == "LAST"
    assert config.dimensions_error(16, 64) is None
    assert "16, 32" in (config.dimensions_error(20, 64) or "")
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    anything = PoolerConfig.from_folder(tmp_path)
    assert anything.dimensions_error(20, 64) is None
    assert "[1, 64]" in (anything.dimensions_error(65, 64) or "")
    (tmp_path / "config.json").write_text("{}")
    assert "matryoshka" in (PoolerConfig.from_folder(tmp_path).dimensions_error(8, 64) or "")


def test_a_base_model_checkpoint_loads_as_qwen3_embedding_ships(make_model, tmp_path: Path) -> None:
    """Qwen3-Embedding's weights are a base-model save (``layers.0...``, no ``model.`` prefix, tied
    LM head) under a ``Qwen3ForCausalLM`` config."""
    import transformers

    source = make_model("qwen3", tie_word_embeddings=True)
    base = transformers.AutoModel.from_pretrained(source, dtype=torch.float32)
    folder = tmp_path / "qwen3-embedding-like"
    base.save_pretrained(folder)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "embed_tokens.weight" in set(f.keys())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]})
    )
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, runner="pooling")
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=6)
    want = reference_embeddings(source, prompts, "LAST")
    for g, w in zip(llm.embed(prompts), want, strict=True):
        assert torch.allclose(torch.tensor(g), w, atol=ATOL)


def test_an_input_may_fill_the_context_but_not_exceed_it(make_model) -> None:
    from tokenmill.errors import ContextLengthError

    llm = LLM(str(make_model("qwen3")), dtype="float32", max_model_len=32, runner="pooling")
    full = _prompts(llm.tokenizer.vocab_size, 1, seed=7, max_len=1)[0] * 32
    assert len(llm.embed([full])[0]) == 64  # no room for output is needed
    with pytest.raises(ContextLengthError, match="the input has 33 tokens"):
        llm.embed([full + full[:1]])


def test_pooling_requests_are_batched_into_one_step(make_model) -> None:
    """32 inputs that fit the step's token budget are prefilled and pooled by one engine step."""
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine.input_processor import CheckedParams

    llm = LLM(str(make_model("qwen3")), dtype="float32", max_model_len=64, runner="pooling")
    engine = llm.engine
    prompts = _prompts(llm.tokenizer.vocab_size, 32, seed=8, max_len=20)
    assert sum(map(len, prompts)) <= engine.config.max_num_batched_tokens
    assert engine.pooler_config is not None
    checked = CheckedParams(SamplingParams(max_tokens=1), 0, pooling=engine.pooler_config.params())
    for i, prompt in enumerate(prompts):
        engine.add_processed(engine.input_processor.process_prompt(f"r{i}", prompt, checked))
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs if o.finished and o.pooled) == sorted(
        f"r{i}" for i in range(32)
    )
    assert not engine.has_unfinished_requests()
