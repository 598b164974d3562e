"""Refuse a GGUF file tokenmill cannot serve, in one line, before any conversion starts.

A GGUF file that is cut short, holds a tensor type or an architecture tokenmill has no code
for, or whose tensors disagree with its own metadata otherwise fails deep inside a loader,
minutes in, with a traceback about numpy reshapes. ``check_gguf_file`` reads only the header
(with ``gguf.GGUFReader``, the reader transformers and vLLM use; the format is never parsed
by hand here) and compares sizes and shapes, so start-up stops at once with one line naming
the file and the problem. Nothing is dequantized. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.model import gguf_config

SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
"""Tensor types whose blocks tokenmill reads."""

SUPPORTED_ARCHITECTURES = (
    "gemma2",
    "gemma3",
    "llama",  # also Mistral, and Mixtral (a llama file with experts)
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
)
"""``general.architecture`` values tokenmill serves: a family in its registry whose config
transformers' GGUF reader writes, or ``model/gguf_config.py`` maps (OLMo 2, Mixtral)."""

TRANSFORMERS_EXPERT_WIDTHS = {
    "qwen2moe": {"expert_feed_forward_length": 1408, "expert_shared_feed_forward_length": 5632},
    "qwen3moe": {"expert_feed_forward_length": 768},
}
"""The expert widths transformers' GGUF reader assumes (its config classes' defaults: it reads
no ``expert_feed_forward_length``); a file with others would load misshapen."""


def _fail(path: Path, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {' '.join(problem.split())}")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_gguf_file(path: Path) -> Any:
    """Raise ``ModelLoadError`` (one line) if ``path`` is not a GGUF file tokenmill can serve;
    else return its ``gguf.GGUFReader`` (parsing the metadata again costs seconds on a large
    vocabulary, so a caller reuses it).

    Checks, in order: the header reads; ``general.architecture`` is supported; every tensor's
    type is supported and its data lies inside the file; the embedding and each block's
    attention and MLP projections have the shapes the metadata implies.
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise _fail(path, f"reading a GGUF file needs the gguf package: {exc}") from None
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader trips on a bad header or a short file alike
        with open(path, "rb") as f:
            gguf_magic = f.read(4) == b"GGUF"
        detail = (str(exc).splitlines() or [type(exc).__name__])[0]
        what = "is truncated or corrupt" if gguf_magic else "is not a GGUF file"
        raise _fail(path, f"{what} (the GGUF reader says: {detail})") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _fail(
            path,
            f"architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    _check_readable(path, reader, arch)
    size = path.stat().st_size
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise _fail(
                path,
                f"tensor {tensor.name!r} has type {kind}, which is not supported; "
                f"supported: {', '.join(SUPPORTED_TYPES)}",
            )
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes < int(tensor.n_bytes):
            raise _fail(
                path,
                f"is truncated: tensor {tensor.name!r} needs bytes up to {end} "
                f"but the file has {size}",
            )
    _check_shapes(path, reader, arch)
    return reader


def _check_readable(path: Path, reader: Any, arch: str) -> None:
    """What the config mapping (transformers' or ``gguf_config``'s) would load as some other
    model, refused by name."""
    problem = gguf_config.unsupported(reader)
    if problem is not None:
        raise _fail(path, problem)
    for key, width in TRANSFORMERS_EXPERT_WIDTHS.get(arch, {}).items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and value != width:
            raise _fail(
                path,
                f"{arch}.{key} is {value}, but transformers' GGUF reader does not read it and "
                f"assumes {width}; only {arch} files of those widths are supported",
            )
    if arch == "phi3":
        factors = [t.name for t in reader.tensors if t.name.startswith("rope_factors_")]
        if factors:
            raise _fail(
                path,
                f"a phi3 file with LongRoPE factors ({', '.join(factors)}) is not supported: "
                "transformers' GGUF reader drops them and would run plain RoPE",
            )
        n_embd = _field(reader, "phi3.embedding_length")
        n_head = _field(reader, "phi3.attention.head_count")
        rotary = _field(reader, "phi3.rope.dimension_count")
        known = isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0
        head = n_embd // n_head if known else None
        if isinstance(rotary, int) and head and rotary != head:
            raise _fail(
                path,
                f"phi3.rope.dimension_count is {rotary}, not the head size {head}: "
                "transformers' GGUF reader does not read it and would rotate whole heads",
            )


def _check_shapes(path: Path, reader: Any, arch: str) -> None:
    """The embedding and every block's projections against the metadata's widths."""

    def meta(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    n_embd, n_head, n_ff = (
        meta("embedding_length"),
        meta("attention.head_count"),
        meta("feed_forward_length"),
    )
    if not isinstance(n_embd, int) or not isinstance(n_head, int) or n_head <= 0:
        raise _fail(path, f"{arch}.embedding_length or {arch}.attention.head_count is missing")
    n_kv = meta("attention.head_count_kv")
    n_kv = n_kv if isinstance(n_kv, int) else n_head
    k_len = meta("attention.key_length") or n_embd // n_head
    v_len = meta("attention.value_length") or k_len
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens.data) if tokens is not None else None)
    want: dict[str, list[int]] = {
        "attn_q": [n_head * k_len, n_embd],
        "attn_k": [n_kv * k_len, n_embd],
        "attn_v": [n_kv * v_len, n_embd],
        "attn_output": [n_embd, n_head * v_len],
    }
    if isinstance(n_ff, int):  # an array (per-layer widths) is not checked
        want.update(
            ffn_gate=[n_ff, n_embd],
            ffn_up=[n_ff, n_embd],
            ffn_down=[n_embd, n_ff],
        )
    if arch == "phi3":  # fused projections: attn_qkv is [q|k|v], ffn_up is [gate|up]
        want["attn_qkv"] = [(n_head + 2 * n_kv) * k_len, n_embd]
        if isinstance(n_ff, int):
            want["ffn_up"] = [2 * n_ff, n_embd]
    explain = (
        f"embedding_length {n_embd}, head_count {n_head}, head_count_kv {n_kv}, "
        f"key_length {k_len}, value_length {v_len}, feed_forward_length {n_ff}"
    )
    n_exp = meta("expert_count")
    n_ff_exp = meta("expert_feed_forward_length") or n_ff  # Mixtral's is feed_forward_length
    if isinstance(n_exp, int) and n_exp > 0 and isinstance(n_ff_exp, int):
        want.update(  # the router, and each layer's experts stacked: [experts, out, in]
            ffn_gate_inp=[n_exp, n_embd],
            ffn_gate_exps=[n_exp, n_ff_exp, n_embd],
            ffn_up_exps=[n_exp, n_ff_exp, n_embd],
            ffn_down_exps=[n_exp, n_embd, n_ff_exp],
        )
        explain += f", expert_count {n_exp}, expert width {n_ff_exp}"
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # ggml lists the row width first
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            need = [vocab if isinstance(vocab, int) else shape[0], n_embd]
            why = f"a vocabulary of {need[0]} and embedding_length {n_embd}"
        elif len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in want:
            need, why = want[parts[2]], explain
        else:
            continue
        if shape != need:
            raise _fail(
                path,
                f"tensor {tensor.name!r} has shape {shape} but {why} ({arch} metadata) need {need}",
            )
