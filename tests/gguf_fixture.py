"""Write a GGUF file from one of the tests' tiny Hugging Face folders, as llama.cpp would.

``write_gguf(folder, out, family, qtype)`` follows llama.cpp's ``convert_hf_to_gguf.py``:
the metadata keys it writes for each architecture, the tensor names of gguf's own
``TensorNameMap``, Llama's (and Mistral's) Q/K row permutation, Gemma's norms stored as
``weight + 1``, 1-D tensors in F32, and the byte-level BPE tokenizer as ``gpt2`` with its
merges, token types, special ids and chat template. Quantized types come from
``gguf.quants.quantize`` where gguf has a quantizer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16);
gguf 0.19 only *dequantizes* the K types, so Q4_K, Q5_K and Q6_K are packed here by a small
test-only quantizer whose bytes ``gguf.quants.dequantize`` reads back (checked by
``tests/model/test_gguf_fixtures.py``). Nothing here needs llama.cpp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors import safe_open

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
"""The GGUF tensor types tokenmill serves, in the order the tests parametrize them."""

K_TYPES = {"Q4_K", "Q5_K", "Q6_K"}
"""Types whose blocks are 256 values wide: every quantized row must be a multiple of 256."""

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral as llama; the name tells transformers
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with expert tensors
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
"""The ``general.architecture`` llama.cpp writes for each test family."""

_EXPERT = re.compile(
    r"model\.layers\.(?P<bid>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<x>\d+)\."
    r"(?P<w>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_EXPERT_GGUF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_FLOAT32_2D = ("ffn_gate_inp.weight",)
"""2-D tensors llama.cpp's converter (and its quantize tool) always keep in F32: routers."""

FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}

TensorEdit = Callable[[str, np.ndarray], np.ndarray | None]
"""``edit(gguf_name, array) -> array | None``: change a tensor before it is written (None drops it)."""


# --- the K-quant packers (test-only; the inverse of gguf.quants' dequantizers) ---------


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _pack_q4_q5_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: 8 sub-blocks of 32, ``x = d*sc*q - dmin*m`` with 6-bit sc, m."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # the offset only ever lowers the range
    hi = sub.max(axis=-1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    offset = -lo
    d = _f16(scale.max(axis=-1) / 63).astype(np.float64)
    dmin = _f16(offset.max(axis=-1) / 63).astype(np.float64)
    sc = np.clip(np.ceil(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(offset, dmin[:, None])), 0, 63).astype(np.uint8)
    eff = d[:, None] * sc
    q = np.rint(_safe_div(sub + (dmin[:, None] * m)[..., None], eff[..., None]))
    q = np.clip(q, 0, levels).astype(np.uint8)  # (n, 8, 32)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    low = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    parts = [_f16(d).view(np.uint8).reshape(n, 2), _f16(dmin).view(np.uint8).reshape(n, 2)]
    parts.append(scales)
    if bits == 5:
        high = (q >> 4) & 1  # sub-block j's fifth bit is bit j of qh[l]
        qh = np.zeros((n, 32), np.uint8)
        for j in range(8):
            qh |= high[:, j] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _pack_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16, ``x = d*sc*(q - 32)`` with signed 8-bit sc."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16).astype(np.float64)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(scale.max(axis=-1) / 127).astype(np.float64)
    sc = np.clip(np.ceil(_safe_div(scale, d[:, None])), 0, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(sub, eff[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 256)
    low = (q & 0x0F).reshape(n, 2, 2, 64)  # element c*128 + h*64 + p
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)  # element c*128 + s*32 + l
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    qh = qh.reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d).view(np.uint8).reshape(n, 2)], axis=1)


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` (float32, rows of the block size) in ``qtype``'s bytes, as gguf stores them."""
    kind = T[qtype]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype not in K_TYPES:
        return gguf.quants.quantize(w, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = w.reshape(-1, w.shape[-1])
    if rows.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} values, not {w.shape}")
    blocks = rows.reshape(-1, block)
    packed = _pack_q6_k(blocks) if qtype == "Q6_K" else _pack_q4_q5_k(blocks, int(qtype[1]))
    assert packed.shape[1] == size
    return packed.reshape(*w.shape[:-1], w.shape[-1] // block * size)


# --- llama.cpp's transforms ------------------------------------------------------------


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (interleaved to split rotary halves)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(folder: Path) -> dict[str, np.ndarray]:
    """The folder's safetensors weights, as float32 numpy arrays."""
    out = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            out[key] = f.get_tensor(key).float().numpy()
    return out


def to_gguf_tensors(folder: Path, family: str) -> dict[str, np.ndarray]:
    """``{gguf tensor name: float32 array}`` after llama.cpp's per-architecture transforms."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[family]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg["num_hidden_layers"])
    out = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    weights = hf_weights(folder)
    for key, w in weights.items():
        if key == "lm_head.weight" and np.array_equal(w, weights["model.embed_tokens.weight"]):
            continue  # the embedding is the head; llama.cpp writes no output.weight
        if m := _EXPERT.fullmatch(key):  # stacked per layer: [experts, out, in]
            kind = _EXPERT_GGUF.get(m["w"], "down")
            experts.setdefault(f"blk.{m['bid']}.ffn_{kind}_exps.weight", {})[int(m["x"])] = w
            continue
        if key.endswith("shared_expert_gate.weight"):  # [1, hidden] written as [hidden]
            w = w.reshape(-1)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {key}")
        if arch == "llama" and key.endswith("q_proj.weight"):
            w = permute(w, cfg["num_attention_heads"])
        elif arch == "llama" and key.endswith("k_proj.weight"):
            w = permute(w, cfg["num_key_value_heads"])
        if family in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            w = w + 1.0
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    rope = cfg.get("rope_parameters") or {}
    if family == "phi3" and rope.get("rope_type") == "longrope":  # Phi3MiniModel's extras
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[x] for x in sorted(per_expert)]).astype(np.float32)
    return out


def from_gguf_tensor(name: str, w: np.ndarray, cfg: dict, family: str) -> np.ndarray:
    """Undo :func:`to_gguf_tensors`' transform of one tensor (for the round-trip tests)."""
    if GGUF_ARCH[family] == "llama" and name.endswith("attn_q.weight"):
        return unpermute(w, cfg["num_attention_heads"])
    if GGUF_ARCH[family] == "llama" and name.endswith("attn_k.weight"):
        return unpermute(w, cfg["num_key_value_heads"])
    if family in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return w - 1.0
    return w


# --- metadata --------------------------------------------------------------------------


def _add_params(writer: gguf.GGUFWriter, cfg: dict, family: str, arch: str) -> None:
    """The hyperparameters llama.cpp's converter writes for ``family``."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("full_attention", rope).get("rope_theta", cfg.get("rope_theta", 10000.0))
    writer.add_rope_freq_base(float(theta))
    if (swa_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(float(swa_theta))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "gemma3" and cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if family == "phi3":  # Phi3MiniModel: the rotary width and the original context
        rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)
        writer.add_rope_dimension_count(int(head_dim * rotary))
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        if cfg.get("sliding_window") is not None:
            writer.add_sliding_window(cfg["sliding_window"])
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if family in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    """The folder's byte-level BPE as llama.cpp's ``_set_vocab_gpt2`` writes it."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    for t in spec.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "token ids must be dense"
    tokens = [t for t, _ in by_id]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, bos/eos ids, add_bos_token and the chat template, as llama.cpp reads them
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)


def write_gguf(
    hf_folder: Path,
    out: Path,
    arch: str,
    qtype: str = "F32",
    *,
    general_arch: str | None = None,
    edit: TensorEdit | None = None,
    types: dict[str, str] | None = None,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write ``hf_folder`` (a tiny model of test family ``arch``) to GGUF file ``out``.

    2-D weights (the embedding included) are stored in ``qtype``, 1-D norms in F32.
    ``general_arch`` overrides ``general.architecture`` (for refusal tests), ``edit`` may
    change or drop any tensor before it is written, ``types`` overrides one tensor's type,
    ``metadata(writer)`` adds keys of its own.
    """
    family = arch
    cfg = json.loads((hf_folder / "config.json").read_text())
    gguf_arch = general_arch or GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(out), gguf_arch)
    # Not "mistral": transformers then reads a llama file as its mistral type, which gguf
    # 0.19 has no tensor map for (NotImplementedError); real files carry longer names.
    writer.add_name(f"Tiny {family.capitalize()}")
    _add_params(writer, cfg, family, GGUF_ARCH[family])
    writer.add_file_type(FILE_TYPE[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if metadata is not None:
        metadata(writer)
    _add_tokenizer(writer, hf_folder)
    for name, w in to_gguf_tensors(hf_folder, family).items():
        if edit is not None and (w := edit(name, w)) is None:  # type: ignore[assignment]
            continue
        default = "F32" if w.ndim < 2 or name.endswith(_FLOAT32_2D) else qtype
        kind = (types or {}).get(name, default)
        if kind == "F32":
            writer.add_tensor(name, w)
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        elif kind in QTYPES:
            writer.add_tensor(name, quantize(w, kind), raw_dtype=T[kind])
        else:  # a type tokenmill does not read: zero blocks of the right size
            raw = np.zeros(gguf.quant_shape_to_byte_shape(w.shape, T[kind]), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def model_overrides(family: str, qtype: str = "F32") -> dict:
    """``make_model`` overrides for a model transformers' GGUF loader reads back whole.

    transformers reads no ``attention.key_length`` for qwen3, so its head_dim is Qwen3's
    default 128; nor Phi-3's rope scaling, nor Qwen2-MoE's and Qwen3-MoE's expert widths
    (``expert_feed_forward_length``), so those are transformers' defaults; Gemma's head is its embedding; K types need every quantized row to be a multiple of 256 values.
    """
    over: dict = {"head_dim": 128} if family == "qwen3" else {}
    if family in ("gemma2", "gemma3"):
        over["tie_word_embeddings"] = True  # as Gemma ships; llama.cpp's gemma2 has no output
    if family == "phi3":  # transformers reads no phi3 rope scaling: plain RoPE
        over["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "qwen2_moe":  # transformers' defaults: its GGUF reader reads no expert widths
        over.update(moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    if family == "qwen3_moe":
        over["moe_intermediate_size"] = 768
    if qtype not in K_TYPES:
        return over
    over.update(hidden_size=256, intermediate_size=512)
    if family in ("gemma2", "gemma3"):
        over["head_dim"] = 64
    if family in ("gemma2", "gemma3"):
        over["query_pre_attn_scalar"] = 64
    return over


# ---- what the GGUF test modules share -------------------------------------------------------
def layer_projections(llm: Any) -> dict[str, Any]:
    """Every projection of the layers but MoE routers (kept in float, as llama.cpp does)."""
    model = llm.engine.executor.driver_worker.model
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith("layers.")
        and hasattr(module, "out_features")
        and not name.endswith(("router", "shared_expert_gate"))
    }


def float_weight(linear: Any, in_features: int) -> Any:
    """A float projection's weight [out, in] from its forward (the loader packs it away):
    identity rows in, W^T (+ bias) out, exact in float32."""
    import torch

    out = linear(torch.eye(in_features))
    if linear.bias is not None:
        out = out - linear.bias
    return out.t().float()


def assert_blocks_as_in_the_file(native: Any, reference: Any, kind: type) -> dict[str, Any]:
    """The native load's projections are ``kind`` and hold the float32 load's weights: exactly
    for int4 groups (the file's own codes, scales and offsets), within half a step for int8
    per channel. Returns the pairs (name -> (ours, theirs)) for further checks."""
    import torch

    from tokenmill.model.quant import Int4Linear, QuantizedLinear

    ours, theirs = layer_projections(native), layer_projections(reference)
    assert ours.keys() == theirs.keys() and ours
    for name, module in ours.items():
        assert isinstance(module, kind), (name, type(module))
        assert not isinstance(theirs[name], QuantizedLinear), name
        want = float_weight(theirs[name], module.in_features)
        got = module.dequantize(torch.float32)
        if kind is Int4Linear:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        else:
            step = module.scales[:, None]
            assert ((got - want).abs() <= step / 2 + 1e-6).all(), name
    return {name: (module, theirs[name]) for name, module in ours.items()}


def fp32_greedy(path: Path, texts: list[str], max_tokens: int = 8) -> tuple[Any, list, list]:
    """tokenmill on a GGUF file in float32, greedy: (the LLM, the prompts' ids, the tokens)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=128)
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, prompts, [o.outputs[0].token_ids for o in outputs]


def refusal(path: Path) -> str:
    """What the start-up check says of a refused GGUF file: one line, after the path."""
    import pytest

    from tokenmill.errors import ModelLoadError
    from tokenmill.model.gguf_checks import check_gguf_file

    with pytest.raises(ModelLoadError) as info:
        check_gguf_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")
