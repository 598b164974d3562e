"""The demo model: deterministic, atomic to build, and a standard HF Llama folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.model import demo
from tokenmill.model.demo import (
    build_bpe_tokenizer,
    build_demo_model,
    demo_model_path,
)
from tokenmill.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_demo_model_path_builds_once_in_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    path = demo_model_path()
    assert path == tmp_path / "demo-v1"
    assert all((path / name).is_file() for name in MODEL_FILES)
    # No staging folders are left behind, and a second call reuses the folder.
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v1"]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_demo_model_path_defaults_to_home_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOKENMILL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert demo.cache_root() == tmp_path / ".cache" / "tokenmill"


def test_losing_the_build_race_uses_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process renames its complete build in first: ours is discarded, not merged."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    final = tmp_path / "demo-v1"
    real_build = demo.build_demo_model
    staging_folders: list[Path] = []

    def build_while_another_process_wins(folder: str | Path) -> Path:
        staging_folders.append(Path(folder))
        real_build(final)  # the other process completes first
        (final / "winner").write_text("yes")
        return real_build(folder)

    monkeypatch.setattr(demo, "build_demo_model", build_while_another_process_wins)
    path = demo_model_path()
    assert path == final
    assert (final / "winner").read_text() == "yes"
    assert staging_folders and staging_folders[0].parent == tmp_path
    assert not staging_folders[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-v1"]


def test_build_is_deterministic(tmp_path: Path, demo_dir: Path) -> None:
    again = build_demo_model(tmp_path / "again")
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_config_matches_tokenizer_and_weights(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    tok = Tokenizer.from_pretrained(demo_dir)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == tok.vocab_size
    assert 2048 <= tok.vocab_size <= 4096
    im_end = tok.token_to_id("<|im_end|>")
    assert config["bos_token_id"] == generation["bos_token_id"] == tok.bos_token_id == 0
    assert generation["eos_token_id"] == [tok.eos_token_id, im_end]
    assert config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]


def test_weights_have_hf_llama_names_shapes_and_init(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    weights = load_file(str(demo_dir / "model.safetensors"))
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor))
        else:
            assert abs(tensor.std().item() - 0.02) < 0.002, name
    assert not torch.equal(weights["model.embed_tokens.weight"], weights["lm_head.weight"])


def test_demo_tokenizer_chatml(demo_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(demo_dir)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id("<|im_start|>")]
    text = "The quick brown fox jumps over the lazy dog."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text, add_special_tokens=False)) < len(text) // 2  # real merges


def test_demo_loads_in_transformers(demo_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(demo_dir))
    tok = Tokenizer.from_pretrained(demo_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    messages = [{"role": "user", "content": "Tell me a story about 🐉 dragons."}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids == hf_tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tok.vocab_size)
    assert torch.isfinite(logits).all()


def test_build_bpe_tokenizer_for_test_models(tmp_path: Path) -> None:
    corpus = "tiny corpus for a tiny model\nanother line of tiny text\n" * 3
    backend = build_bpe_tokenizer(tmp_path, corpus=corpus, vocab_size=300, chat_template=None)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == backend.get_vocab_size() <= 300
    special = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
    assert [tok.token_to_id(token) for token in special] == [0, 1, 2, 3]
    assert not tok.has_chat_template
    # Byte-level: text never seen in training still round-trips.
    text = "unseen 文字 ✓"
    assert tok.decode(tok.encode(text)) == text
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode(text) == hf.encode(text)
