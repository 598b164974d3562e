"""``model/gguf_weights.py``'s memory bounds, which hold by construction, not by measurement:
the reader and its metadata fields are let go once the checkpoint is open, every read
dequantizes a bounded chunk of rows, and the chunks give the whole tensor's values and int8
channels bit for bit."""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gguf_fixture import model_overrides, write_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model import gguf_weights
from tokenmill.model.config import ModelConfig
from tokenmill.model.gguf_folder import gguf_folder
from tokenmill.model.gguf_weights import GGUFCheckpoint
from tokenmill.model.registry import expected_tensors

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("own_gguf_cache")
"""Converted GGUF folders go to a per-session cache, not the repository's."""


@pytest.fixture(scope="module")
def llama_q6k(make_model, tmp_path_factory) -> Path:
    """A llama file in Q6_K: requantized to int8, with llama.cpp's permuted Q/K rows."""
    folder = make_model("llama", **model_overrides("llama", "Q6_K"))
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "llama-q6k.gguf", "llama", "Q6_K")


def _open(path: Path) -> GGUFCheckpoint:
    folder = gguf_folder(path)
    cfg = ModelConfig.from_folder(folder)
    ckpt = GGUFCheckpoint.open(folder, cfg, expected_tensors(cfg))
    assert ckpt is not None
    return ckpt


def test_the_reader_and_its_fields_are_let_go_once_open(llama_q6k, monkeypatch) -> None:
    """A 262k-token vocabulary is a million small arrays in the reader's fields: kept for the
    whole load they were half of Gemma 3's peak."""
    readers: list[weakref.ref[Any]] = []
    open_reader = gguf_weights._open_reader

    def tracked(path: Path) -> Any:
        reader = open_reader(path)
        readers.append(weakref.ref(reader))
        assert reader.fields  # the metadata fields were built
        return reader

    monkeypatch.setattr(gguf_weights, "_open_reader", tracked)
    ckpt = _open(llama_q6k)
    assert ckpt.entries and len(readers) == 1
    assert readers[0]() is None  # freed by reference count, no collection needed


def test_the_plain_view_reader_parses_as_ggufs_own(llama_q6k) -> None:
    """``_open_reader`` only changes the array type of gguf's views, never what they hold."""
    ours, theirs = gguf_weights._open_reader(llama_q6k), gguf.GGUFReader(llama_q6k)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert str(ours.fields[name].contents()) == str(field.contents()), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert type(mine.data) is np.ndarray
        assert mine.data_offset == want.data_offset
        assert np.array_equal(mine.data, want.data), mine.name


def test_reads_are_bounded_chunks_of_the_whole_tensor(llama_q6k, monkeypatch) -> None:
    """Each chunk's fp32 rows stay within ``_CHUNK_BYTES`` (one head's rows for a permuted
    Q/K), and the chunks, and the int8 channels built from them, equal the whole tensor's."""
    ckpt = _open(llama_q6k)
    hidden = ckpt.entries["model.embed_tokens.weight"].shape[1]
    monkeypatch.setattr(gguf_weights, "_CHUNK_BYTES", 3 * 4 * hidden)  # 3 rows of most
    num_chunked = 0
    for name, entry in ckpt.entries.items():
        whole = ckpt._float(entry)
        chunks = list(ckpt._row_chunks(entry))
        if entry.whole:
            assert len(chunks) == 1
        else:
            per_head = entry.shape[0] // ckpt._heads(entry) if ckpt._permuted(entry) else 1
            row_bytes = whole[0].nbytes
            for chunk in chunks:
                assert chunk.nbytes <= max(gguf_weights._CHUNK_BYTES, per_head * row_bytes)
                assert chunk.shape[0] % per_head == 0 or chunk is chunks[-1]
            num_chunked += len(chunks) > 1
        assert np.array_equal(np.concatenate(chunks), whole), name
        if entry.whole or ckpt.kind(name) != "int8":
            continue
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.from_numpy(whole).to(dtype).float()  # the whole tensor at once
            want_scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            want_codes = torch.round(w / want_scales[:, None]).clamp(-127, 127).to(torch.int8)
            codes, scales = ckpt.int8_channels(name, dtype)
            assert torch.equal(codes, want_codes), name
            assert torch.equal(scales, want_scales), name
    assert num_chunked > 5  # the embedding, the projections, Q/K by heads
    ckpt.close()


def test_a_truncated_file_names_the_tensor(llama_q6k, tmp_path) -> None:
    """Tensor bytes are read from the file (not its map): a short read is an error."""
    ckpt = _open(llama_q6k)
    entry = ckpt.entries["model.layers.0.mlp.down_proj.weight"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama_q6k.read_bytes()[: entry.tensor.data_offset + 10])
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight is truncated"):
        gguf_weights._read_raw(replace(entry, path=cut))
