"""Load a Hugging Face model folder (config + safetensors) into its registered model.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``, checks every
tensor name and shape against the registry's layout for the architecture, fuses q/k/v and
gate/up projections, and fails with a message that names the file and tensor at fault.
"""

from __future__ import annotations

import io
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill import kernels
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.attention_backend import AttentionBackend, default_attention_backend
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu import cpu_info
from tokenmill.model.cpu_dtype import cpu_auto_dtype
from tokenmill.model.gguf_weights import GROUP_SIZE, GGUFCheckpoint
from tokenmill.model.host_memory import trim_freed_heap
from tokenmill.model.layers import gemv_layout_wanted
from tokenmill.model.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    int8_channels,
    quantize_linear,
)
from tokenmill.model.registry import WeightSpec, expected_tensors, model_class, weight_layout
from tokenmill.model.tensor_parallel import (
    TPShard,
    check_supported,
    parallelize,
    read_shard,
    shard_config,
)

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

LM_HEAD_QUANTIZATION: str | None = "int8"
"""What an untied LM head becomes when ``--quantization`` is set (measured against int4 and
none in docs/benchmarks.md)."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtype names accepted by ``--dtype`` (besides ``auto``) and found in ``torch_dtype``."""


def resolve_dtype(
    requested: str, cfg: ModelConfig, device: torch.device, quantization: str | None = None
) -> torch.dtype:
    """The dtype weights and activations run in; ``auto`` is explained in the log.

    ``auto`` keeps the checkpoint's precision on a GPU; on a CPU it follows the one rule in
    ``model/cpu_dtype.py`` (bf16 where the CPU computes it natively or the AVX2 kernels read
    it: 1.6x fp32's one-stream speed on an AVX2-only EPYC, 250M Llama; else fp32: fp16 GEMMs
    have no such units on CPU, measured 3x slower than bf16 at 128 rows).
    ``quantization`` needs no rule of its own: the int kernels take bf16 activations, which
    ``auto`` already picks wherever bf16 runs fast (natively, or on the AVX2 kernels).
    """
    if requested != "auto":
        dtype = TORCH_DTYPES[requested]
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                f"--dtype bfloat16: {torch.cuda.get_device_name(device)} cannot run bfloat16; use float16 or float32"
            )
        return dtype
    declared = TORCH_DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.float32)
    if device.type != "cpu":
        logger.info("dtype auto: %s, as the checkpoint declares", declared)
        return declared
    info = cpu_info()
    declared_name = str(declared).removeprefix("torch.")
    name, why = cpu_auto_dtype(declared_name, info.flags, _kernels_read_bf16())
    keeps = name != "float32" and declared_name == "float32"
    logger.info(
        "dtype auto: checkpoint is %s; using %s, %s (%s)%s",
        declared_name,
        name,
        why,
        info.describe(),
        "; --dtype float32 keeps float32" if keeps else "",
    )
    return TORCH_DTYPES[name]


def _kernels_read_bf16() -> bool:
    """Whether tokenmill's CPU kernels serve bf16 projections here without bf16 hardware:
    the AVX2 table (its GEMV converts bf16 weights to fp32 in registers; ``active_isa`` is
    ``none`` where the extension did not load)."""
    return kernels.active_isa() == "avx2"


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


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes lie in its file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the data in the file."""
    nbytes: int


CONVERT_CHUNK_BYTES = 16 << 20
"""Bytes of a tensor read at a time when its checkpoint dtype is converted on load."""
EMBED_CHUNK_ROWS = 8192
"""Rows of a tied embedding read at a time into its int8 head (10 MB of Gemma 3's in bf16)."""


class _Checkpoint:
    """Tensor names, shapes and files of a checkpoint; each tensor is read into its destination.

    Reads use plain file reads, not safetensors' mmap: mapped pages of the file count towards
    RSS for as long as it stays open, so loading a 1 GB checkpoint through the mapping held
    the mapping plus the copies (2 GB) at its peak. Read this way, the peak stays near the
    size of the loaded model.
    """

    def __init__(self, files: list[Path]) -> None:
        self.entries: dict[str, _Entry] = {}
        for path in files:
            try:
                with safe_open(
                    str(path), framework="pt"
                ) as handle:  # validates the header and offsets
                    names = list(handle.keys())
                with path.open("rb") as f:
                    (header_len,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(header_len))
            except SafetensorError as exc:
                raise ModelLoadError(
                    f"{path}: corrupt or unreadable safetensors file: {exc}"
                ) from None
            except OSError as exc:
                raise ModelLoadError(f"{path}: cannot read: {exc}") from None
            for name in names:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in self.entries:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} also appears in {self.entries[name].path}"
                    )
                info = header[name]
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}"
                    )
                begin, end = info["data_offsets"]
                self.entries[name] = _Entry(
                    path, dtype, tuple(info["shape"]), 8 + header_len + begin, end - begin
                )

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with tensor ``name``, converting its dtype if
        needed a chunk at a time (``CONVERT_CHUNK_BYTES``): a float32 checkpoint served in bf16
        held each tensor whole in float32 beside its bf16 copy, three times the bf16 size at
        once (Gemma 3's 262,144 x 640 embedding: 671 MB beside 335 MB)."""
        entry = self.entries[name]
        try:
            with entry.path.open("rb", buffering=0) as f:
                f.seek(entry.start)
                if out.dtype == entry.dtype:
                    self._fill(f, out, name)
                    return
                flat = out.view(-1)
                per = max(1, CONVERT_CHUNK_BYTES // entry.dtype.itemsize)
                staging = torch.empty(min(per, flat.numel()), dtype=entry.dtype)
                for i0 in range(0, flat.numel(), per):
                    n = min(per, flat.numel() - i0)
                    self._fill(f, staging[:n], name)
                    flat[i0 : i0 + n].copy_(staging[:n])
        except OSError as exc:
            raise ModelLoadError(f"{entry.path}: cannot read tensor {name!r}: {exc}") from None

    def _fill(self, f: io.RawIOBase, target: torch.Tensor, name: str) -> None:
        """Read the next ``target.nbytes`` bytes of ``f`` into the contiguous ``target``."""
        buffer = target.view(-1).view(torch.uint8).numpy().data  # a memoryview over the bytes
        while buffer:
            got = f.readinto(buffer)
            if not got:
                raise ModelLoadError(f"{self.entries[name].path}: tensor {name!r} is truncated")
            buffer = buffer[got:]

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of tensor ``name`` (dim 0), reading only their bytes."""
        entry = self.entries[name]
        row_shape = entry.shape[1:]
        row_bytes = entry.nbytes // max(1, entry.shape[0])
        key = f"{name}[{start}:{stop}]"
        self.entries[key] = _Entry(
            entry.path,
            entry.dtype,
            (stop - start, *row_shape),
            entry.start + start * row_bytes,
            (stop - start) * row_bytes,
        )
        out = torch.empty((stop - start, *row_shape), dtype=dtype)
        try:
            self.read_into(key, out)
        finally:
            del self.entries[key]
        return out

    def discard(self, name: str) -> None:
        self.entries.pop(name, None)


def check_checkpoint(folder: Path, cfg: ModelConfig) -> _Checkpoint | GGUFCheckpoint:
    """Open the checkpoint and check its headers against the registry's layout: files, tensor
    names, dtypes, shapes and data offsets (so a truncated file is found), reading no tensor
    data, so it is cheap enough to run before the server listens. Errors name the file and the tensor (missing, unexpected or misshapen) and say what the
    architecture expects. A folder converted from a GGUF file is read from that file
    (``model/gguf_weights.py``).
    """
    expected = expected_tensors(cfg)
    gguf = GGUFCheckpoint.open(folder, cfg, expected)
    if gguf is not None:
        return gguf  # its names come from the registry's layout, so none is missing
    ckpt = _Checkpoint(_checkpoint_files(folder))
    if "model.embed_tokens.weight" not in ckpt.entries and "embed_tokens.weight" in ckpt.entries:
        # A base-model save (no LM head prefix), as embedding checkpoints such as
        # Qwen3-Embedding ship: the same tensors without the ``model.`` prefix.
        ckpt.entries = {
            name if name == "lm_head.weight" else f"model.{name}": entry
            for name, entry in ckpt.entries.items()
        }
    if cfg.tie_word_embeddings:
        ckpt.discard("lm_head.weight")  # some tied checkpoints still store it
    missing = sorted(set(expected) - set(ckpt.entries))
    if missing:
        raise ModelLoadError(
            f"{folder}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"that {cfg.architecture} needs"
        )
    unexpected = sorted(set(ckpt.entries) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ModelLoadError(
            f"{ckpt.entries[name].path}: unexpected tensor {name!r} for {cfg.architecture}"
            f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}; "
            "its config.json does not declare the module it belongs to"
        )
    for name, shape in expected.items():
        if ckpt.entries[name].shape != shape:
            raise ModelLoadError(
                f"{ckpt.entries[name].path}: tensor {name!r} has shape {ckpt.entries[name].shape}, expected {shape}"
            )
    return ckpt


def _resolve(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    """(parent module, attribute name) of a dotted parameter path."""
    *path, attr = target.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, attr


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cfg: ModelConfig | None = None,
    quantization: str | None = None,
    group_size: int = 128,
    prepack: bool = True,
    attn_backend: AttentionBackend | None = None,
    tensor_parallel: TPShard | None = None,
    gguf_blocks: bool = True,
) -> CausalLM:
    """Build the registered model for ``folder`` and fill it with the checkpoint's weights.

    A config for the Transformers fallback (``cfg.model_impl``) is loaded by
    ``model/transformers_fallback.py`` instead, with Transformers' own classes.

    Every parameter comes from the registry's layout (``model/registry.weight_layout``).
    With ``quantization``, each projection is quantized as soon as it is read, so at most
    one projection is ever held in the load dtype. An untied LM head is quantized to int8 in
    both modes (int4 there cost more accuracy than it saved time, docs/benchmarks.md). A
    tied one is one copy for both ends: int8 rows under quantization, else (bf16 or fp32
    on CPU) the GEMV's blocks; the embedding rows are gathered from it. With
    ``tensor_parallel``, the modules are built at one rank's sizes, only that rank's slice of
    each tensor is read (``model/tensor_parallel.py``) and the collectives are installed.
    bf16 projections on CPU go in tokenmill's GEMV layout (``layers.gemv_layout_wanted``),
    other dtypes in oneDNN's. A GGUF file's quantized projections run on the int kernels
    as they are (``gguf_blocks``, unless ``quantization`` asks for tokenmill's own) or are
    dequantized into ``dtype`` (``--dtype float32``): ``model/gguf_weights.py``.
    """
    folder = Path(folder)
    cfg = cfg or ModelConfig.from_folder(folder)
    if cfg.model_impl == "transformers":
        from tokenmill.model.transformers_fallback import (
            check_features,
            load_transformers_model,
        )

        check_features(quantization, enable_lora=False)
        return load_transformers_model(folder, cfg, dtype, device, max_positions, attn_backend)
    ckpt = check_checkpoint(folder, cfg)
    if quantization is not None and device.type != "cpu":
        raise ConfigError(
            f"--quantization {quantization}: the int8/int4 kernels are CPU-only; use --device cpu"
        )
    pack = prepack and device.type == "cpu"  # False keeps plain weights to inspect
    gguf = ckpt if isinstance(ckpt, GGUFCheckpoint) else None
    native = (
        gguf is not None
        and gguf_blocks
        and quantization is None
        and tensor_parallel is None
        and device.type == "cpu"
    )
    built: dict[tuple[int, str], Callable[[torch.Tensor | None], QuantizedLinear]] = {}
    """Projections whose GGUF blocks are taken as they are: (id of parent, name) -> maker."""
    gemv = gemv_layout_wanted()
    num_packed = num_gemv = num_quantized = 0

    from tokenmill.model.decoder import build_rope

    rope = build_rope(cfg, max_positions).to(device)
    local_rope = (
        build_rope(cfg, max_positions, local=True).to(device)
        if cfg.local_rope_theta is not None
        else None
    )
    backend = attn_backend or default_attention_backend(device)
    built_cfg = cfg
    if tensor_parallel is not None:
        check_supported(cfg, tensor_parallel.world_size)
        built_cfg = shard_config(cfg, tensor_parallel)
    with torch.device("meta"):
        model = model_class(cfg)(built_cfg, max_positions, rope, backend, local_rope)
    model.config = cfg

    def put_blocks(spec: WeightSpec) -> bool:
        """Keep a projection's GGUF blocks for the int kernels (built with its bias in
        ``convert``); False when they are float and take the plain path."""
        assert gguf is not None
        kinds = {gguf.kind(n) for n in spec.sources}
        if "float" in kinds:
            return False
        parent, name = _resolve(model, spec.target.rsplit(".", 1)[0])
        shape = (
            sum(gguf.entries[n].shape[0] for n in spec.sources),
            gguf.entries[spec.sources[0]].shape[1],
        )
        like = torch.empty((), dtype=dtype).expand(shape)  # shape, dtype and device only
        if kinds == {"int4"} and shape[1] % GROUP_SIZE == 0:
            parts = [gguf.int4_groups(n) for n in spec.sources]
            groups = tuple(torch.cat(p) for p in zip(*parts, strict=True))

            def make(bias: torch.Tensor | None) -> QuantizedLinear:
                return Int4Linear(like, bias, GROUP_SIZE, groups)  # type: ignore[arg-type]

        else:  # some source has more than 4 bits: int8 for the fused projection
            rows = [gguf.int8_channels(n) for n in spec.sources]  # per channel: fuses by rows
            channels = (torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))

            def make(bias: torch.Tensor | None) -> QuantizedLinear:
                return Int8Linear(like, bias, channels=channels)

        built[(id(parent), name)] = make
        return True

    def put(module: nn.Module, attr: str, spec: WeightSpec) -> None:
        """Read ``spec``'s sources (fused along dim 0 when several) straight into one parameter."""
        names = spec.sources
        if tensor_parallel is not None:
            shard = read_shard(
                spec,
                cfg,
                tensor_parallel,
                dtype,
                lambda name, lo, hi: ckpt.read_rows(name, lo, hi, dtype),
            )
            setattr(module, attr, nn.Parameter(shard.to(device), requires_grad=False))
            return
        shapes = [ckpt.entries[n].shape for n in names]
        value = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype)
        row = 0
        for name, shape in zip(names, shapes, strict=True):
            ckpt.read_into(name, value[row : row + shape[0]])
            row += shape[0]
        setattr(module, attr, nn.Parameter(value.to(device), requires_grad=False))

    def convert(parent: nn.Module, name: str, method: str | None, may_pack: bool) -> None:
        """Quantize (``method``) or prepack one projection."""
        nonlocal num_packed, num_gemv, num_quantized
        linear = getattr(parent, name)
        make = built.pop((id(parent), name), None)
        if make is not None:
            setattr(parent, name, make(None if linear.bias is None else linear.bias.data))
            num_quantized += 1
        elif method is not None and linear.weight is not None:
            bias = None if linear.bias is None else linear.bias.data
            setattr(parent, name, quantize_linear(linear.weight.data, bias, method, group_size))
            num_quantized += 1
        elif pack and may_pack:
            if gemv and linear.pack_for_gemv(reuse_storage=True):  # read by ``put`` alone
                num_gemv += 1
            else:
                num_packed += linear.pack_for_onednn()

    layout = weight_layout(cfg)
    head_method = None if quantization is None else LM_HEAD_QUANTIZATION
    embed_name = "model.embed_tokens.weight"
    int8_tied_head = (
        cfg.tie_word_embeddings
        and tensor_parallel is None
        and device.type == "cpu"
        and kernels.available()
        and (
            quantization is not None
            or (native and gguf is not None and gguf.kind(embed_name) != "float")
        )
    )
    embed_from_blocks = native and int8_tied_head
    """A GGUF file's tied embedding goes from its blocks to the int8 head a chunk of rows at
    a time, never whole in the model dtype beside its int8 copy (Gemma 3's: 335 MB in bf16)."""
    embed_in_chunks = (
        int8_tied_head
        and not embed_from_blocks
        and isinstance(ckpt, _Checkpoint)
        and any(spec.sources == (embed_name,) for spec in layout)
    )
    """A safetensors checkpoint's tied embedding likewise: read in the model dtype a chunk of
    rows at a time into the int8 head at the end, instead of held whole through the load
    and beside its int8 copy (Gemma 3 int8: a load peak of 1.5 GB for 0.7 GB served)."""
    pending: list[tuple[nn.Module, str, str | None, bool]] = []
    """Projections read but not converted yet: converted once their bias is read too."""
    for index, spec in enumerate(layout):
        module, attr = _resolve(model, spec.target)
        if (embed_from_blocks or embed_in_chunks) and spec.sources == (embed_name,):
            pass  # read below, into the tied head
        elif not (native and spec.kind in ("projection", "expert") and put_blocks(spec)):
            put(module, attr, spec)
        if spec.kind != "plain":
            parent, name = _resolve(model, spec.target.rsplit(".", 1)[0])
            method = head_method if spec.kind == "lm_head" else quantization
            pending.append((parent, name, method, spec.kind != "expert"))
        is_last = index + 1 == len(layout)
        if is_last or layout[index + 1].layer != spec.layer:  # a layer is complete: convert now
            for parent, name, method, may_pack in pending:
                convert(parent, name, method, may_pack)
            pending.clear()
    if cfg.tie_word_embeddings:
        if int8_tied_head:
            # One int8 copy serves both ends: the head's GEMV reads half bf16's bytes (a
            # tied head is every token's largest read: 56 MB of SmolLM2's, 335 MB of Gemma
            # 3's in bf16) and the embedding rows are looked up from it. On AVX-512 in the
            # tile layout (AMX or VNNI: Gemma 3's head 1.2-1.4x faster than the rows at one
            # row, 3.3-3.8x at 16), elsewhere the rows; both write the logits in fp32.
            if embed_from_blocks:
                assert gguf is not None
                like = torch.empty((), dtype=dtype).expand(gguf.entries[embed_name].shape)
                channels = gguf.int8_channels(embed_name, dtype)  # rounded as read into dtype
                head = Int8Linear(like, None, channels=channels)
            elif embed_in_chunks:
                assert isinstance(ckpt, _Checkpoint)
                shape = ckpt.entries[embed_name].shape
                like = torch.empty((), dtype=dtype).expand(shape)
                chunks = (  # rounded to dtype as read, as the whole embedding would be
                    ckpt.read_rows(embed_name, lo, min(lo + EMBED_CHUNK_ROWS, shape[0]), dtype)
                    for lo in range(0, shape[0], EMBED_CHUNK_ROWS)
                )
                channels = int8_channels(chunks, (shape[0], shape[1]))
                head = Int8Linear(like, None, channels=channels)
            else:
                head = Int8Linear(model.embed.data, None)
            head.lookup_dtype = dtype
            model.lm_head = head
            model.embed = None
            num_quantized += 1
            weights = head.out_features * head.in_features  # (int_weight() would unpack tiles)
            logger.info(
                "tied LM head and embedding: one int8 copy (%.0f MB; bf16 would be %.0f MB)",
                weights / 1e6,
                weights * 2 / 1e6,
            )
        else:
            model.lm_head.weight = model.embed  # converting would copy the embedding
            # One copy in the GEMV's blocks serves both ends: the head streams them as every
            # other projection does (the embedding's row-major rows, read a few side by
            # side, ran Gemma 3's 335 MB bf16 head at a fraction of the bandwidth on AVX2)
            # and the embedding rows are gathered from them (``Linear.embedding``).
            if (
                pack
                and gemv
                and tensor_parallel is None
                and model.lm_head.pack_for_gemv(reuse_storage=True)
            ):
                model.embed = None  # written over: the rows come from the blocks now
                num_gemv += 1
    for module in model.modules():  # state built on the meta device, not in the checkpoint
        reset = getattr(module, "reset_state", None)
        if reset is not None:
            reset(device)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ModelLoadError(
            f"{folder}: the {cfg.architecture} layout leaves {left[:3]} unset (a registry bug)"
        )
    if tensor_parallel is not None:
        parallelize(model, cfg, tensor_parallel)
    model.eval()
    if gguf is not None:
        gguf.log_placements()
        gguf.close()
    if num_quantized and not native:
        logger.info(
            "quantized %d projections to %s (%s)", num_quantized, quantization, cpu_info().isa
        )
    if num_gemv:
        logger.info("packed %d %s projections for tokenmill's GEMV", num_gemv, dtype)
    if num_packed:
        logger.info(
            "prepacked %d %s projections for oneDNN (%s)", num_packed, dtype, cpu_info().describe()
        )
    if device.type == "cpu":
        logger.info("%s", kernels.describe())
    trim_freed_heap()  # the checkpoint-dtype copies freed while converting stay resident otherwise
    return model
