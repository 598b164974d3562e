"""A GGUF file tokenmill cannot serve is refused at start-up in one line naming the file
and the problem: not GGUF, truncated, an unsupported tensor type or architecture, a tensor
whose shape disagrees with the metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_fixture import write_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_checks import check_gguf_file

pytest.importorskip("gguf")

TYPES = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"
ARCHS = "gemma2, gemma3, llama, olmo2, phi3, qwen2, qwen2moe, qwen3, qwen3moe"


def _refused(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_gguf_file(path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def llama(make_model):
    return make_model("llama")


def test_a_good_file_passes(llama, tmp_path) -> None:
    check_gguf_file(write_gguf(llama, tmp_path / "ok.gguf", "llama", "Q8_0"))


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip" * 4)
    assert _refused(path).startswith(f"{path}: is not a GGUF file (the GGUF reader says: ")


def test_truncated_file(llama, tmp_path) -> None:
    path = write_gguf(llama, tmp_path / "cut.gguf", "llama")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    message = _refused(path)
    assert message.startswith(f"{path}: is truncated")
    assert "'output.weight'" in message or "reader says" in message


def test_truncated_header(llama, tmp_path) -> None:
    path = write_gguf(llama, tmp_path / "head.gguf", "llama")
    path.write_bytes(path.read_bytes()[:200])
    assert _refused(path).startswith(f"{path}: is truncated or corrupt (the GGUF reader says: ")


def test_unsupported_tensor_type(llama, tmp_path) -> None:
    path = write_gguf(
        llama, tmp_path / "iq4.gguf", "llama", types={"blk.0.attn_v.weight": "IQ4_NL"}
    )
    assert _refused(path) == (
        f"{path}: tensor 'blk.0.attn_v.weight' has type IQ4_NL, which is not supported; "
        f"supported: {TYPES}"
    )


def test_unsupported_architecture(llama, tmp_path) -> None:
    path = write_gguf(llama, tmp_path / "rwkv.gguf", "llama", general_arch="rwkv6")
    assert _refused(path) == (f"{path}: architecture 'rwkv6' is not supported; supported: {ARCHS}")


def test_tensor_of_the_wrong_shape(llama, tmp_path) -> None:
    path = write_gguf(
        llama,
        tmp_path / "shape.gguf",
        "llama",
        edit=lambda name, w: w[:-16] if name == "blk.1.ffn_up.weight" else w,
    )
    assert _refused(path) == (
        f"{path}: tensor 'blk.1.ffn_up.weight' has shape [112, 64] but embedding_length 64, "
        "head_count 4, head_count_kv 2, key_length 16, value_length 16, feed_forward_length "
        "128 (llama metadata) need [128, 64]"
    )


def test_wrong_embedding_shape(llama, tmp_path) -> None:
    def edit(name, w):
        return w[:-3] if name == "token_embd.weight" else w

    path = write_gguf(llama, tmp_path / "embd.gguf", "llama", edit=edit)
    message = _refused(path)
    assert message.startswith(f"{path}: tensor 'token_embd.weight' has shape [")
    assert "a vocabulary of" in message


def test_llm_refuses_with_the_same_line(llama, tmp_path, monkeypatch) -> None:
    from tokenmill import LLM

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    path = write_gguf(
        llama, tmp_path / "iq4.gguf", "llama", types={"blk.0.attn_v.weight": "IQ4_NL"}
    )
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), dtype="float32")
    assert str(info.value) == _refused(path)
    assert not (tmp_path / "cache" / "gguf").exists()  # refused before any conversion
