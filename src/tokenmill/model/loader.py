"""Load a Hugging Face model folder (config + safetensors) into the shared decoder.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``, checks every
tensor name and shape against the architecture, fuses q/k/v and gate/up projections, and
fails with a message that names the file and tensor at fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.decoder import DecoderModel
from tokenmill.model.layers import Linear, RotaryEmbedding

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names accepted by ``--dtype`` (besides ``auto``) and found in ``torch_dtype``."""


def resolve_dtype(requested: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` follows the checkpoint's torch_dtype, except bf16/fp16 on CPU -> float32."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    declared = TORCH_DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.float32)
    if device.type == "cpu" and declared != torch.float32:
        logger.info("dtype auto: checkpoint is %s, using float32 on CPU (half-precision matmuls are slow there)", declared)
        return torch.float32
    return declared


def _checkpoint_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: invalid shard index: {exc}") from None
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: lists shard {f.name}, which is missing")
        return files
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


class _Checkpoint:
    """Tensor names, shapes and files of a checkpoint; tensors are read one at a time.

    Reading lazily keeps peak memory near the size of the loaded model instead of
    checkpoint + fused copies + prepacked copies all at once.
    """

    def __init__(self, files: list[Path]) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name in self.files:
                        raise ModelLoadError(f"{path}: tensor {name!r} also appears in {self.files[name]}")
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
                    self.files[name] = path
            except SafetensorError as exc:
                raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from None
            except OSError as exc:
                raise ModelLoadError(f"{path}: cannot read: {exc}") from None
            self._handles[path] = handle

    def read(self, name: str) -> torch.Tensor:
        path = self.files[name]
        try:
            return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {exc}") from None

    def discard(self, name: str) -> None:
        self.shapes.pop(name, None)
        self.files.pop(name, None)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cfg: ModelConfig | None = None,
) -> DecoderModel:
    """Build the decoder for ``folder`` and fill it with the checkpoint's weights."""
    folder = Path(folder)
    cfg = cfg or ModelConfig.from_folder(folder)
    ckpt = _Checkpoint(_checkpoint_files(folder))
    expected = _expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        ckpt.discard("lm_head.weight")  # some tied checkpoints still store it
    missing = sorted(set(expected) - set(ckpt.shapes))
    if missing:
        raise ModelLoadError(f"{folder}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(ckpt.shapes) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ModelLoadError(f"{ckpt.files[name]}: unexpected tensor {name!r} for {cfg.architecture}")
    for name, shape in expected.items():
        if ckpt.shapes[name] != shape:
            raise ModelLoadError(
                f"{ckpt.files[name]}: tensor {name!r} has shape {ckpt.shapes[name]}, expected {shape}"
            )
    pack = device.type == "cpu" and dtype == torch.float32
    num_packed = 0

    with torch.device("meta"):
        model = DecoderModel(cfg, max_positions)
    model.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling).to(device)

    def put(module: nn.Module, attr: str, *names: str) -> None:
        value = torch.cat([ckpt.read(n) for n in names]) if len(names) > 1 else ckpt.read(names[0])
        param = nn.Parameter(value.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        setattr(module, attr, param)

    def pack_all(module: nn.Module) -> None:
        """Prepack a module's projections right away, so only one layer is ever unpacked."""
        nonlocal num_packed
        if pack:
            num_packed += sum(m.pack_for_onednn() for m in module.modules() if isinstance(m, Linear))

    put(model, "embed", "model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed
    else:
        put(model.lm_head, "weight", "lm_head.weight")
        pack_all(model.lm_head)  # a tied LM head is left unpacked: packing would copy the embedding
    put(model.norm, "weight", "model.norm.weight")
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        put(layer.attn.qkv, "weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        if cfg.qkv_bias:
            put(layer.attn.qkv, "bias", a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        put(layer.attn.o, "weight", a + "o_proj.weight")
        if cfg.qk_norm:
            put(layer.attn.q_norm, "weight", a + "q_norm.weight")
            put(layer.attn.k_norm, "weight", a + "k_norm.weight")
        put(layer.mlp.gate_up, "weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        put(layer.mlp.down, "weight", p + "mlp.down_proj.weight")
        put(layer.input_norm, "weight", p + "input_layernorm.weight")
        put(layer.post_attn_norm, "weight", p + "post_attention_layernorm.weight")
        pack_all(layer)
    model.eval()
    if pack:
        logger.info("prepacked %d/%d projections for oneDNN", num_packed, len(model.linears()))
    return model
