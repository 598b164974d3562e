"""A GGUF file's tensors read in place, and its quantized blocks run on tokenmill's int kernels.

``model/gguf_folder.py`` turns a GGUF file into a folder with the config and tokenizer the
rest of tokenmill reads; the weights are read from the file itself, through the ``gguf``
package's reader (a memory map; never a parser of our own), under the Hugging Face names
the model registry expects (``gguf.get_tensor_name_map``, as transformers and vLLM map
them) and with llama.cpp's conversion undone as transformers undoes it (Q/K rows of the
``llama`` architecture un-permuted, Gemma's norms stored as ``1 + weight`` shifted back).
Phi-3's fused ``attn_qkv`` and ``ffn_up`` ([gate|up]) are the registry's fused tensors as
they are. A mixture-of-experts layer's experts are stacked in one ``[experts, out, in]``
tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``): each expert
reads its own slice of it, blocks included; Qwen2-MoE's ``[1, hidden]`` shared-expert gate
is stored as ``[hidden]``.

How each tensor type runs (docs/gguf.md has the table and the precision each one loses):

- ``Q4_0``, ``Q4_1``, ``Q4_K``: every 32 weights share one scale and one offset
  (``w = q * scale + offset``, ``q`` in 0..15), which is exactly tokenmill's asymmetric int4
  layout in groups of 32 (``model/quant.Int4Linear``): the codes and fp32 scales are taken
  from the blocks as they are, nothing is rounded again.
- ``Q8_0``, ``Q5_0``, ``Q5_1``, ``Q5_K``, ``Q6_K``: more than 4 bits a weight, and a scale per
  16 or 32 weights; tokenmill's int8 kernels take one scale per output channel, so the
  projection is requantized to int8 per channel, from its rows dequantized a chunk at a time.
- ``F32``, ``F16``, ``BF16``, and embeddings of any type: read into the model dtype (the
  embedding is looked up by row; a tied LM head reads the same rows), except a quantized
  embedding tied to the head, which the loader requantizes straight into the int8 head.

``--dtype float32`` or ``bfloat16`` (or ``--quantization``) dequantizes every tensor into that
dtype instead, as the reference does.

Memory: every read dequantizes about ``_CHUNK_BYTES`` of fp32 rows at a time, never a whole
tensor (Gemma 3's 262,144 x 640 tied embedding is 671 MB in fp32), and the reader's metadata
fields (a 262k-token vocabulary is a million small arrays) are let go as soon as the
architecture is read: the config and tokenizer come from the converted folder.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model import gguf_checks
from tokenmill.model.config import ModelConfig
from tokenmill.model.quant import int8_channels

logger = logging.getLogger(__name__)

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
"""Types whose blocks are tokenmill's int4 groups of 32 exactly."""
INT8_TYPES = frozenset({"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"})
"""Types requantized to int8 per output channel."""
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
SUPPORTED_TYPES = frozenset(gguf_checks.SUPPORTED_TYPES)
"""What ``gguf_checks`` lets through; each runs as one of the three kinds above."""
assert SUPPORTED_TYPES == INT4_TYPES | INT8_TYPES | FLOAT_TYPES
GROUP_SIZE = 32
"""Weights per scale of the int4 types (a K-quant's sub-block)."""

_ARCH_OF_MODEL_TYPE = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_PERMUTED_QK = frozenset({"llama"})
"""Architectures whose Q/K rows llama.cpp's converter interleaves for its RoPE."""
_SHIFTED_NORMS = frozenset({"gemma2", "gemma3"})
"""Architectures whose RMSNorm weights llama.cpp stores as ``1 + weight``."""
_EXPERT = re.compile(r"(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)")
"""A per-expert projection in the registry's names (``...mlp.experts.3.gate_proj``); llama.cpp
stacks each layer's experts into one ``[experts, out, in]`` tensor (``ffn_gate_exps``),
named through gguf's map of ``...mlp.experts.gate_proj`` as transformers maps it."""
_CHUNK_BYTES = 32 << 20
"""fp32 bytes of rows dequantized at a time (gguf's dequantizer takes about as much again):
Gemma 3's 262,144-row embedding dequantized whole took 671 MB in fp32 plus gguf's
temporaries."""
_SOURCE_FILE = "gguf_source.json"
"""What ``gguf_folder`` writes beside the config: the GGUF file the folder came from."""


@dataclass(frozen=True)
class GGUFEntry:
    """One tensor of the file under its Hugging Face name."""

    path: Path
    shape: tuple[int, ...]
    """Hugging Face order ([out, in] for a projection)."""
    gguf_name: str
    qtype: str
    """The GGUF type's name: F32, Q4_K, ..."""
    tensor: Any
    """gguf's ``ReaderTensor``: its ``data`` maps the file."""
    expert: int | None = None
    """Which expert of a stacked ``[experts, out, in]`` tensor (``ffn_*_exps``) this is."""

    @property
    def data(self) -> np.ndarray:
        """The tensor's raw array (rows first), this expert's rows only when stacked."""
        data = self.tensor.data
        return data if self.expert is None else data[self.expert]

    @property
    def whole(self) -> bool:
        """Read whole rather than by rows: not a 2-D projection stored as rows (a norm, or
        a ``[1, hidden]`` gate llama.cpp stores as ``[hidden]``)."""
        return len(self.shape) != 2 or self.data.ndim != 2


def source_file(folder: Path) -> Path | None:
    """The GGUF file a converted folder came from, if it is one and the file is still there."""
    marker = folder / _SOURCE_FILE
    if not marker.is_file():
        return None
    try:
        path = Path(json.loads(marker.read_text())["gguf_file"])
    except (OSError, ValueError, KeyError):
        return None
    return path if path.is_file() else None


def _reverse_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves in Q/K rows. Rows are
    output channels, so the same reordering applies to codes and per-row scales."""
    per_head = rows.shape[0] // num_heads // 2
    w = rows.reshape(num_heads, per_head, 2, *rows.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(rows.shape))


class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face names; the loader's view of a checkpoint.

    ``read_into`` and ``read_rows`` dequantize (gguf's own dequantizers) into any dtype;
    ``int4_groups`` and ``int8_channels`` give a projection's quantized form for the int kernels.
    """

    def __init__(
        self,
        path: Path,
        tensors: dict[str, Any],
        arch: str,
        names: dict[str, tuple[str, int | None]],
        cfg: ModelConfig,
    ):
        """``tensors``: gguf's ``ReaderTensor`` by GGUF name (the reader itself, with its
        metadata fields, is not kept); ``names``: Hugging Face name -> (GGUF name, expert of
        a stacked tensor or None)."""
        self.path = path
        self.arch = arch
        self._num_heads = int(cfg.num_heads)
        self._num_kv_heads = int(cfg.num_kv_heads)
        self.entries: dict[str, GGUFEntry] = {}
        for hf_name, (gguf_name, expert) in names.items():
            t = tensors[gguf_name]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if expert is not None:  # one [out, in] slice of [experts, out, in]
                if len(shape) != 3 or expert >= shape[0]:
                    raise ModelLoadError(
                        f"{path}: tensor {gguf_name} has shape {list(shape)}, which holds no "
                        f"expert {expert} for {hf_name}"
                    )
                shape = shape[1:]
            entry = GGUFEntry(path, shape, gguf_name, t.tensor_type.name, t, expert)
            self.entries[hf_name] = entry
        self.placements: Counter[tuple[str, str]] = Counter()
        """(GGUF type, where it runs) -> tensors, for the start-up log."""

    @classmethod
    def open(
        cls, folder: Path, cfg: ModelConfig, expected: dict[str, tuple[int, ...]]
    ) -> GGUFCheckpoint | None:
        """The checkpoint for a folder converted from a GGUF file, or None when the folder is
        not one (or some tensor the model needs has no GGUF name: then the folder's float
        copy serves)."""
        path = source_file(folder)
        if path is None:
            return None
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        try:
            reader = _open_reader(path)
        except Exception as exc:  # the reader's own errors: one line naming the file
            raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
        field = reader.fields.get("general.architecture")
        arch = str(field.contents()) if field is not None else ""
        tensors = {t.name: t for t in reader.tensors}
        del field, reader  # its metadata fields: hundreds of MB for a 262k-token vocabulary
        arch = _ARCH_OF_MODEL_TYPE.get(arch, arch)
        arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
        if arch_id is None:
            return None
        name_map = get_tensor_name_map(arch_id, int(cfg.num_layers))
        present = set(tensors)
        names: dict[str, tuple[str, int | None]] = {}
        for hf_name in expected:
            base, _, suffix = hf_name.rpartition(".")
            expert = None
            if m := _EXPERT.fullmatch(base):  # experts.3.gate_proj -> ffn_gate_exps[3]
                base, expert = f"{m['block']}.experts.{m['proj']}", int(m["expert"])
            gguf_base = name_map.get_name(base)
            gguf_name = f"{gguf_base}.{suffix}"
            if gguf_base is None or gguf_name not in present:
                logger.info(
                    "%s: %s has no GGUF tensor of its own (%s); reading the converted folder",
                    path.name,
                    hf_name,
                    gguf_name if gguf_base else "unmapped",
                )
                return None
            names[hf_name] = (gguf_name, expert)
        ckpt = cls(path, tensors, arch, names, cfg)
        for hf_name, entry in ckpt.entries.items():
            if entry.shape != expected[hf_name] and expected[hf_name] == (1, *entry.shape):
                # Qwen2-MoE's shared_expert_gate: [1, hidden], which llama.cpp stores 1-D
                ckpt.entries[hf_name] = entry = replace(entry, shape=expected[hf_name])
            if entry.shape != expected[hf_name]:
                raise ModelLoadError(
                    f"{path}: tensor {entry.gguf_name} has shape {list(entry.shape)}, "
                    f"expected {list(expected[hf_name])} for {hf_name}"
                )
            if entry.qtype not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor {entry.gguf_name} has type {entry.qtype}, which tokenmill "
                    f"does not run (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
                )
        return ckpt

    # ---- the loader's checkpoint interface ------------------------------------------
    def discard(self, name: str) -> None:
        self.entries.pop(name, None)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` with tensor ``name`` dequantized (and converted to ``out``'s dtype)."""
        entry = self.entries[name]
        self.placements[(entry.qtype, str(out.dtype).removeprefix("torch."))] += 1
        rows = out.view(entry.shape)
        row = 0
        for chunk in self._row_chunks(entry):  # an fp32 copy of a chunk only
            rows[row : row + chunk.shape[0]].copy_(torch.from_numpy(chunk))
            row += chunk.shape[0]

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of tensor ``name`` in ``dtype`` (tensor-parallel shards)."""
        entry = self.entries[name]
        if entry.whole or self._permuted(entry):  # rows reordered across the tensor
            return torch.from_numpy(self._float(entry)[start:stop]).to(dtype)
        return torch.from_numpy(self._float(entry, start, stop)).to(dtype)  # only these rows

    # ---- quantized forms ----------------------------------------------------------------
    def kind(self, name: str) -> str:
        """``int4``, ``int8`` or ``float``: the kernels tensor ``name`` runs on as it is."""
        qtype = self.entries[name].qtype
        return "int4" if qtype in INT4_TYPES else "int8" if qtype in INT8_TYPES else "float"

    def int4_groups(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes (uint8 0..15, [out, in]) and fp32 scales and offsets ([out, in / 32]), so
        that ``w = code * scale + offset``: the blocks' own values, nothing requantized."""
        entry = self.entries[name]
        out_features, in_features = entry.shape
        codes, scale, low = _int4_blocks(entry.qtype, _blocks(entry))
        codes = codes.reshape(out_features, in_features)
        scale = scale.reshape(out_features, in_features // GROUP_SIZE)
        low = low.reshape(out_features, in_features // GROUP_SIZE)
        codes, scale, low = (self._transform_rows(entry, a) for a in (codes, scale, low))
        self.placements[(entry.qtype, "int4 g32 (exact)")] += 1
        return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low)

    def int8_channels(
        self, name: str, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor ``name`` requantized to int8 per output channel (codes [out, in], fp32
        scales [out]) from its rows dequantized a chunk at a time, each rounded to ``dtype``
        first: a tied embedding is quantized from the values the model dtype holds, as it
        was when read whole into that dtype."""
        entry = self.entries[name]
        self.placements[(entry.qtype, "int8 per channel (requantized)")] += 1
        chunks = (torch.from_numpy(chunk).to(dtype) for chunk in self._row_chunks(entry))
        return int8_channels(chunks, (entry.shape[0], int(np.prod(entry.shape[1:]))))

    def log_placements(self) -> None:
        """One line: each GGUF type, how many tensors and where they run."""
        parts = [
            f"{qtype} x{n} -> {where}" for (qtype, where), n in sorted(self.placements.items())
        ]
        logger.info("GGUF %s (%s): %s", self.path.name, self.arch, "; ".join(parts))

    def close(self) -> None:
        """Drop the file's memory map (its pages would count towards RSS while it is open)."""
        self.entries.clear()

    # ---- internals ----------------------------------------------------------------------
    def _permuted(self, entry: GGUFEntry) -> bool:
        """Whether llama.cpp reordered this tensor's rows (undone on the whole tensor)."""
        name = entry.gguf_name
        return self.arch in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name)

    def _row_chunks(self, entry: GGUFEntry) -> Iterator[np.ndarray]:
        """The tensor dequantized to fp32 (llama.cpp's changes undone), in consecutive chunks
        of rows of at most ``_CHUNK_BYTES`` (one row, or one head's rows of a permuted Q/K,
        where that is more): the bounded temporary of every read, however large the tensor.
        A tensor read whole (a norm) is one chunk."""
        if entry.whole:
            yield self._float(entry)
            return
        num_rows = entry.shape[0]
        rows = max(1, _CHUNK_BYTES // (4 * int(np.prod(entry.shape[1:]))))
        if self._permuted(entry):  # llama.cpp's reordering stays within a head's rows
            per_head = num_rows // self._heads(entry)
            rows = max(per_head, rows // per_head * per_head)
        for lo in range(0, num_rows, rows):
            yield self._float(entry, lo, min(lo + rows, num_rows))

    def _float(self, entry: GGUFEntry, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows [lo, hi) (all by default) dequantized to fp32, llama.cpp's changes undone."""
        from gguf.quants import dequantize

        data = _read_raw(entry, lo, hi)
        shape = entry.shape
        if hi is not None:  # rows of a 2-D tensor: the raw array's leading dimension
            shape = (hi - lo, *shape[1:])
        try:
            data = np.asarray(dequantize(data, entry.tensor.tensor_type), np.float32)
            data = data.reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            raise ModelLoadError(
                f"{entry.path}: tensor {entry.gguf_name} ({entry.qtype}) cannot be read: {exc}"
            ) from None
        data = self._transform_rows(entry, data)
        if self.arch in _SHIFTED_NORMS and entry.gguf_name.endswith("norm.weight"):
            data = data - 1.0
        if not data.flags.writeable or not data.flags.c_contiguous:  # a view of the file
            data = np.array(data, order="C")
        return data

    def _heads(self, entry: GGUFEntry) -> int:
        return self._num_heads if ".attn_q." in entry.gguf_name else self._num_kv_heads

    def _transform_rows(self, entry: GGUFEntry, rows: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's Q/K permutation on ``rows``: the whole tensor or whole heads."""
        if self._permuted(entry):
            per_head = entry.shape[0] // self._heads(entry)
            return _reverse_permute(rows, rows.shape[0] // per_head)
        return rows


def _open_reader(path: Path) -> Any:
    """gguf's reader of ``path`` (its parser, unchanged), with the file map it slices seen
    as a plain ndarray: it builds one view per metadata value (a million for a 262k-token
    vocabulary), and a ``np.memmap`` view costs twice a plain one's memory and 3x its time
    (684 MB in 34 s against 314 MB in 10 s for Gemma 3's file)."""
    return _plain_view_reader()(path)


@functools.cache
def _plain_view_reader() -> type:
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        """``GGUFReader`` whose ``data`` (the file's memory map) is a plain ndarray view."""

        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)  # its base keeps the map open

    return PlainViewReader


def _read_raw(entry: GGUFEntry, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Rows [lo, hi) (all by default) of the tensor's raw array (``entry.data``: its shape,
    dtype and place in the file are gguf's), read from the file into fresh memory. Plain
    reads, as the loader reads safetensors: pages of the file's map, once touched, stay in
    RSS until the map is dropped (the whole file, 253 MB of Gemma 3's, by the load's end)."""
    view = entry.data
    hi = view.shape[0] if hi is None else hi
    start = entry.tensor.data_offset + lo * view.strides[0]
    if entry.expert is not None:  # one [out, in] slice of [experts, out, in]
        start += entry.expert * entry.tensor.data.strides[0]
    out = np.empty((hi - lo, *view.shape[1:]), view.dtype)
    with open(entry.path, "rb") as f:
        f.seek(start)
        num_read = f.readinto(out.data)
    if num_read != out.nbytes:
        raise ModelLoadError(f"{entry.path}: tensor {entry.gguf_name} is truncated")
    return out


def _blocks(entry: GGUFEntry) -> np.ndarray:
    """The tensor's raw blocks, [n_blocks, bytes per block]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[entry.qtype]]
    data = _read_raw(entry)
    if data.size % type_size:
        raise ModelLoadError(f"{entry.path}: tensor {entry.gguf_name} is truncated")
    return data.reshape(-1, type_size)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """4-bit codes of packed bytes ``qs`` [n, k * width]: per run of ``width`` bytes, the low
    nibbles then the high nibbles (ggml's order in Q4_0, Q4_1 and Q4_K)."""
    runs = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & np.uint8(15)).reshape(qs.shape[0], -1)


def _int4_blocks(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [n, values], scale [n, groups], offset [n, groups]) of ``qtype`` blocks."""
    if qtype == "Q4_0":  # d (f16), 16 bytes of codes; w = d * (q - 8)
        d = _f16(blocks[:, :2])
        return _nibbles(blocks[:, 2:], 16), d, -8.0 * d
    if qtype == "Q4_1":  # d, m (f16), 16 bytes of codes; w = d * q + m
        return _nibbles(blocks[:, 4:], 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if qtype == "Q4_K":  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of codes
        from gguf.quants import Q4_K

        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)
        low = -(dmin * m.astype(np.float32))
        return _nibbles(blocks[:, 16:], 32), scale, low
    raise ValueError(f"{qtype} is not an int4 type")
