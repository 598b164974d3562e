"""Serving configurations to try: settings as ``tokenmill serve`` flags, and the space of them.

A candidate is a small mapping of serve options (vLLM's names, underscores) that differ
from the defaults; it renders as a command line and as a ``--config`` YAML. The space
varies one group of knobs at a time around the defaults (memory strategy, precision,
batching, prefix caching, speculation, threads, replicas) and then pairs the knobs that
interact, so a few dozen candidates cover what a person would try by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import yaml

DEFAULTS: dict[str, Any] = {
    "kv_cache": "paged",
    "dtype": "auto",
    "quantization": None,
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "max_num_seqs": 256,
    "max_num_batched_tokens": None,
    "enable_prefix_caching": True,
    "speculative_config": None,
    "num_threads": None,
    "data_parallel_size": 1,
}
"""What ``tokenmill serve`` runs when a flag is not given (the baseline candidate)."""

REDUCED_PRECISION_KEYS = ("dtype", "quantization", "kv_cache_dtype")
"""Settings that change the numbers the model computes: the correctness gate checks them."""

_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@dataclass(frozen=True)
class Candidate:
    """One configuration: the serve options that differ from ``DEFAULTS``."""

    settings: tuple[tuple[str, Any], ...] = ()
    """Sorted (option, value) pairs; values are JSON-able."""

    @classmethod
    def of(cls, **settings: Any) -> Candidate:
        """A candidate from options; those equal to the default are dropped."""
        for key in settings:
            if key not in DEFAULTS:
                raise ValueError(f"unknown tuning option {key!r}")
        kept = {k: v for k, v in settings.items() if v != DEFAULTS[k]}
        return cls(tuple(sorted((k, _freeze(v)) for k, v in kept.items())))

    def replace(self, **changes: Any) -> Candidate:
        """This candidate with some options set to other values (defaults drop out)."""
        return Candidate.of(**{**{k: _thaw(v) for k, v in self.settings}, **changes})

    @property
    def options(self) -> dict[str, Any]:
        """Every option, defaults included."""
        return {**DEFAULTS, **{k: _thaw(v) for k, v in self.settings}}

    @property
    def key(self) -> str:
        """Stable identity (for resume and the report)."""
        if not self.settings:
            return "default"
        return ",".join(f"{k}={_value_text(_thaw(v))}" for k, v in self.settings)

    @property
    def num_non_default(self) -> int:
        """Flags a user has to set: the simpler configuration has fewer."""
        return len(self.settings)

    @property
    def is_reduced_precision(self) -> bool:
        """Whether the correctness gate applies (non-default dtype, quantization or KV dtype)."""
        return any(k in REDUCED_PRECISION_KEYS for k, _ in self.settings)

    @property
    def precision_key(self) -> tuple[tuple[str, Any], ...]:
        """The settings that decide the numbers: candidates sharing it share a verify run."""
        return tuple((k, v) for k, v in self.settings if k in REDUCED_PRECISION_KEYS)

    def serve_args(self) -> list[str]:
        """The candidate's ``tokenmill serve`` flags."""
        args: list[str] = []
        for key, value in self.settings:
            flag = "--" + key.replace("_", "-")
            value = _thaw(value)
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + key.replace("_", "-"))
            elif isinstance(value, dict):
                args += [flag, json.dumps(value, separators=(",", ":"))]
            else:
                args += [flag, str(value)]
        return args

    def config_yaml(self, model: str, extra: Mapping[str, Any] | None = None) -> str:
        """A vLLM-style ``--config`` file: flag names with dashes, as ``serve --config`` reads it."""
        data: dict[str, Any] = {"model": model}
        for key, value in self.settings:
            value = _thaw(value)
            data[key.replace("_", "-")] = json.dumps(value) if isinstance(value, dict) else value
        data.update(extra or {})
        return yaml.safe_dump(data, sort_keys=False)


def _freeze(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


def _thaw(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("{"):
        return json.loads(value)
    return value


def _value_text(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("method", "spec") + ":" + str(value.get("num_speculative_tokens", ""))
    return str(value)


@dataclass(frozen=True)
class SearchSpace:
    """Values to try per option; the first of each list is tried in every combination."""

    values: dict[str, list[Any]] = field(default_factory=dict)

    def candidates(self, max_pairs: int = 64) -> list[Candidate]:
        """Defaults, then each option alone, then pairs of options that interact."""
        out: list[Candidate] = [Candidate()]
        seen = {Candidate()}

        def add(c: Candidate) -> None:
            if c not in seen:
                seen.add(c)
                out.append(c)

        for key, values in self.values.items():
            for value in values:
                add(Candidate.of(**{key: value}))
        pairs = [
            ("kv_cache", "max_num_seqs"),
            ("quantization", "max_num_seqs"),
            # int4 prefill switches kernel by chunk rows (dequantized GEMM from 512)
            ("quantization", "max_num_batched_tokens"),
            ("quantization", "kv_cache_dtype"),
            ("max_num_seqs", "max_num_batched_tokens"),
            ("quantization", "speculative_config"),
            ("quantization", "num_threads"),
        ]
        num_pairs = 0
        for a, b in pairs:
            for va, vb in product(self.values.get(a, []), self.values.get(b, [])):
                if num_pairs >= max_pairs:
                    return out
                before = len(out)
                add(Candidate.of(**{a: va, b: vb}))
                num_pairs += len(out) - before
        return out


def default_space(
    num_cores: int,
    has_accelerator: bool = False,
    draft_model: str | None = None,
    quantizations: Iterable[str] = ("int8", "int4"),
    resolved_defaults: Mapping[str, Any] | None = None,
) -> SearchSpace:
    """The knobs worth trying on this machine.

    Precisions: the int8/int4 weight kernels, half-precision compute, an fp8 KV cache. Threads and data-parallel replicas split the cores.
    ``resolved_defaults``: what the server's ``auto`` settings resolve to here (``dtype``,
    ``num_threads``); a value equal to one is the default configuration under another name,
    so it is not a candidate (on an AVX2 CPU ``dtype=bfloat16`` and ``auto`` ran the same
    server, and one noisy round apart made the first the winner over the default).
    """
    values: dict[str, list[Any]] = {
        "kv_cache": ["static"],
        "quantization": list(quantizations),
        "dtype": ["bfloat16"] if not has_accelerator else ["float16", "bfloat16"],
        "kv_cache_dtype": ["fp8"],
        "block_size": [32],
        "max_num_seqs": [4, 32],
        # 1024 (a CPU's default) and 2048 (a GPU's): resolved_defaults drops the device's own
        "max_num_batched_tokens": [512, 1024, 2048, 8192],
        "enable_prefix_caching": [False],
        "speculative_config": [_NGRAM],
    }
    if draft_model:
        values["speculative_config"].append(
            {"model": draft_model, "num_speculative_tokens": 3, "method": "draft_model"}
        )
    if num_cores >= 2:
        values["num_threads"] = sorted({max(1, num_cores // 2), num_cores})
        values["data_parallel_size"] = [2] if num_cores >= 4 else []
    if not values.get("data_parallel_size"):
        values.pop("data_parallel_size", None)
    for key, same in (resolved_defaults or {}).items():
        if key in values:
            values[key] = [v for v in values[key] if v != same]
            if not values[key]:
                del values[key]
    return SearchSpace(values)
