"""A GGUF file as a Hugging Face model folder, written once into ``$TOKENMILL_CACHE/gguf/``.

GGUF is how most people who run models on CPUs hold them (llama.cpp's format; PyPI packages
ship trained checkpoints in it). This opens one with transformers' GGUF loader, which reads
it with the ``gguf`` package (the reader vLLM and transformers use): the architecture,
config and tokenizer (vocabulary, merges, special tokens and chat template) come from the
file's metadata, and the tensors are dequantized to float32. For the architectures that
loader has no config mapping for (OLMo 2, Mixtral), ``model/gguf_config.py`` maps the
metadata, transformers' GGUF tokenizer conversion still builds the tokenizer, and the
float copy is read as the native load reads the file (``model/gguf_weights.py``). The
folder it writes (``config.json``, ``model.safetensors``, the tokenizer files) is what every
other part of tokenmill loads, so ``serve``, ``check``, ``plan``, ``verify`` and ``bench``
all take a GGUF file. ``--quantization int8|int4`` then quantizes the float weights for
tokenmill's kernels.

The conversion runs once per file (keyed by its path, size and modification time), under a
file lock so replicas starting together do not race, and is written beside its final name
and renamed, so a crash never leaves half a folder. It needs ``transformers`` and ``gguf``
(``make setup`` installs both); running the quantized blocks directly on tokenmill's kernels,
without the float copy, is not done yet.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tokenmill import envs
from tokenmill.errors import ModelLoadError

logger = logging.getLogger(__name__)


def _key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(ident).hexdigest()[:12]}"


def gguf_folder(path: Path) -> Path:
    """The Hugging Face folder for GGUF file ``path`` (converted on first use)."""
    folder = envs.cache_root() / "gguf" / _key(path)
    if (folder / "config.json").is_file():
        return folder  # checked when it was converted: the key is the file's size and mtime
    from tokenmill.model.gguf_checks import check_gguf_file
    from tokenmill.model.gguf_config import hf_config, own_model_type

    reader = check_gguf_file(path)  # one line at start-up, before any conversion
    try:  # from the header read once: a large vocabulary takes seconds to parse again
        config = hf_config(reader) if own_model_type(reader) else None
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    del reader  # its parsed fields, before the conversion's own memory peak
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            _convert(path, folder, config)
    return folder


def _convert(path: Path, folder: Path, config: dict[str, Any] | None) -> None:
    """Write ``folder``: ``config`` is ``gguf_config``'s mapping, or None where transformers'
    GGUF reader maps the config."""
    try:
        import gguf  # noqa: F401  (both needed; one line says so before either is used)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(
            f"{path}: opening a GGUF file needs transformers and gguf "
            f"(`pip install transformers gguf`): {exc}"
        ) from None
    start = time.monotonic()
    logger.info("%s: reading the GGUF file into %s (once)", path, folder)
    work = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # first: a folder with this marker reads its weights from the file (gguf_weights)
    (work / "gguf_source.json").write_text(
        json.dumps({"gguf_file": str(path.resolve()), "size": path.stat().st_size}, indent=2)
    )
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        if config is None:
            _write_with_transformers(path, work)
        else:
            _write_mapped(path, work, config)
    except ModelLoadError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    except Exception as exc:  # whatever the reader trips on, one line names the file
        shutil.rmtree(work, ignore_errors=True)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: cannot read this GGUF file: {message}") from None
    finally:
        quiet.setLevel(level)
    os.replace(work, folder)
    logger.info("%s: ready in %.0f s", path, time.monotonic() - start)


def _write_with_transformers(path: Path, work: Path) -> None:
    """Config, tokenizer and float32 weights as transformers' GGUF loader reads them."""
    import torch
    import transformers
    from safetensors.torch import save_file

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers' marker of a GGUF load
        del config.quantization_config
    config.architectures = [type(model).__name__]  # what tokenmill's registry looks up
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # the embedding is the head
    save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(work)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(work)
    tokenizer.save_pretrained(work)


def _write_mapped(path: Path, work: Path, config_dict: dict[str, Any]) -> None:
    """Config from ``gguf_config``'s mapping, the tokenizer from transformers' GGUF tokenizer
    conversion (which reads any architecture's vocabulary), and float32 weights read from the
    file as the native load reads them (gguf's tensor names, llama.cpp's transforms undone)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tokenmill.model.config import ModelConfig
    from tokenmill.model.gguf_weights import GGUFCheckpoint
    from tokenmill.model.registry import expected_tensors

    config = transformers.AutoConfig.for_model(**config_dict)
    config.dtype = torch.float32  # the float copy's dtype, as transformers' loads write it
    config.save_pretrained(work)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(work)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, tokenizer_type=config.model_type
    )
    tokenizer.save_pretrained(work)
    cfg = ModelConfig.from_folder(work)
    expected = expected_tensors(cfg)
    ckpt = GGUFCheckpoint.open(work, cfg, expected)
    if ckpt is None:  # the log names the tensor
        raise ModelLoadError(f"{path}: the file lacks a tensor {cfg.architecture} needs")
    weights = {}
    for name, shape in expected.items():
        weights[name] = torch.empty(shape, dtype=torch.float32)
        ckpt.read_into(name, weights[name])
    ckpt.close()
    save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
