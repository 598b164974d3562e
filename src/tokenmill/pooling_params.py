"""PoolingParams: how a prompt-only request turns hidden states into one vector (no torch here).

A pooling request is prefilled like any other and, instead of sampling, returns its final
hidden states pooled (the last token's, the mean over the prompt, or the first token's),
optionally cut to its first ``dimensions`` (Matryoshka) and L2-normalised, as vLLM's
``PoolingParams``. ``PoolerConfig.from_folder`` reads what a checkpoint declares: the
sentence-transformers ``modules.json`` and ``1_Pooling/config.json`` that embedding models
such as Qwen3-Embedding ship, and ``matryoshka_dimensions`` from ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PoolingType = Literal["LAST", "MEAN", "CLS"]

_ST_POOLING_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
"""sentence-transformers' ``1_Pooling/config.json`` flags that tokenmill implements."""


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request returns."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    """L2-normalise the (truncated) vector."""
    dimensions: int | None = None
    """Keep only the first ``dimensions`` values (Matryoshka embeddings); None keeps all."""

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip: such requests share no KV."""
        return self.pooling_type != "LAST"


@dataclass(frozen=True)
class PoolerConfig:
    """The pooling a checkpoint declares, and the output sizes it supports."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    """Trained so that its first values are an embedding too (``dimensions`` allowed)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """The sizes it may be cut to; None: any size up to the hidden size."""
    source: str = "default (last token, normalised, as vLLM pools decoder models)"

    def params(self, dimensions: int | None = None) -> PoolingParams:
        return PoolingParams(self.pooling_type, self.normalize, dimensions)

    def dimensions_error(self, dimensions: int, hidden_size: int) -> str | None:
        """Why ``dimensions`` cannot be served (vLLM's rules), or None if it can."""
        if not self.is_matryoshka:
            return (
                "this model does not support matryoshka representation (no is_matryoshka or "
                "matryoshka_dimensions in its config.json): changing output dimensions would give "
                "poor embeddings"
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return (
                f"dimensions {dimensions} is not one of the model's matryoshka dimensions "
                f"{list(self.matryoshka_dimensions)}"
            )
        if not 1 <= dimensions <= hidden_size:
            return f"dimensions must be in [1, {hidden_size}]"
        return None

    @classmethod
    def from_folder(cls, folder: Path) -> PoolerConfig:
        """Read ``modules.json``/``1_Pooling/config.json`` (sentence-transformers) if present.

        Raises ValueError naming the file when it asks for a pooling tokenmill lacks.
        """
        is_matryoshka, matryoshka = _matryoshka(folder / "config.json")
        modules_path = folder / "modules.json"
        if not modules_path.is_file():
            return cls(is_matryoshka=is_matryoshka, matryoshka_dimensions=matryoshka)
        try:
            modules = json.loads(modules_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{modules_path}: unreadable ({exc})") from None
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        pooling_type: PoolingType = "LAST"
        pooling = types.get("Pooling")
        if pooling is not None:
            config_path = folder / str(pooling.get("path", "1_Pooling")) / "config.json"
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{config_path}: unreadable ({exc})") from None
            chosen = [mode for key, mode in _ST_POOLING_MODES.items() if config.get(key)]
            unsupported = [
                k
                for k, v in config.items()
                if k.startswith("pooling_mode_") and v and k not in _ST_POOLING_MODES
            ]
            if unsupported or len(chosen) != 1:
                raise ValueError(
                    f"{config_path}: pooling {unsupported or chosen or 'none'} is not supported; "
                    "tokenmill pools by exactly one of last token, mean or CLS token"
                )
            pooling_type = chosen[0]
        return cls(
            pooling_type=pooling_type,
            normalize="Normalize" in types,
            is_matryoshka=is_matryoshka,
            matryoshka_dimensions=matryoshka,
            source=f"{modules_path.name} (sentence-transformers)",
        )


def _matryoshka(config_path: Path) -> tuple[bool, tuple[int, ...] | None]:
    """vLLM's reading of ``config.json``: ``matryoshka_dimensions``, or ``is_matryoshka``."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False, None
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return True, tuple(sorted(dims))
    return bool(config.get("is_matryoshka")), None
