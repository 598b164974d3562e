"""One benchmark result file: loading it, the figures lifted from it, its load and rounds,
and naming targets by what differs between their configs.

Shared by ``compare`` (the verdict and table) and ``report`` (the plots).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def round_values(result: dict[str, Any], key: str) -> list[float]:
    """``key``'s value in each measured round; one value for a single run, none if unmeasured."""
    rounds = result.get("rounds") or []
    values = [r.get(key) for r in rounds if isinstance(r, dict)]
    numbers = [v for v in values if isinstance(v, (int, float))]
    if len(values) > 1 and len(numbers) == len(values):
        return [float(v) for v in numbers]
    if key == "output_throughput" and len(result.get("round_output_throughputs") or []) > 1:
        return [float(v) for v in result["round_output_throughputs"]]  # offline results
    value = result.get(key)
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def spread_of(result: dict[str, Any], key: str) -> tuple[float, float] | None:
    """(min, max) of ``key`` over rounds; None for a single run."""
    values = round_values(result, key)
    return (min(values), max(values)) if len(values) > 1 else None


CONFIG_KEYS: tuple[str, ...] = (
    "backend",
    "kv_cache",
    "model",
    "model_id",
    "base_url",
    "endpoint",
    "prompt_format",
    "dtype",
    "device",
    "batch_size",
    "engine_kwargs",
    "ignore_eos",
    "temperature",
    "metadata",
)
"""Settings that tell targets apart (load and workload are not among them: they form sweeps
and are checked by ``workload_warnings``)."""


def config_of(result: dict[str, Any]) -> dict[str, str]:
    """The result's settings as text, ``metadata`` and ``engine_kwargs`` entries flattened."""
    config: dict[str, str] = {}
    for key in CONFIG_KEYS:
        value = result.get(key)
        if isinstance(value, dict):
            config.update({k: value_text(v) for k, v in value.items()})
        elif value is not None:
            text = value_text(value)
            config[key] = text.split("://", 1)[-1] if key == "base_url" else text
    return config


def name_by_config(
    named_results: list[tuple[str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any]]]:
    """Results that share a name but not a config get the name plus what differs.

    Two ``demo`` results run against servers given ``--metadata kv_cache=paged`` and
    ``kv_cache=static`` become ``demo[paged]`` and ``demo[static]``; with several settings
    differing, ``demo[kv_cache=static,max_num_seqs=64]``. Results with one config stay
    one target, so a concurrency sweep keeps its name.
    """
    configs: dict[str, list[dict[str, str]]] = {}
    for name, result in named_results:
        config = config_of(result)
        if config not in configs.setdefault(name, []):
            configs[name].append(config)
    renamed = []
    for name, result in named_results:
        distinct = configs[name]
        if len(distinct) > 1:
            config = config_of(result)
            keys = [
                k
                for k in dict.fromkeys(k for c in distinct for k in c)
                if len({c.get(k) for c in distinct}) > 1
            ]
            parts = [
                config.get(k, "-") if len(keys) == 1 else f"{k}={config.get(k, '-')}" for k in keys
            ]
            name = f"{name}[{','.join(parts)}]"
        renamed.append((name, result))
    return renamed


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a result JSON (tokenmill or vLLM), with a label and the source path recorded."""
    file = Path(path)
    try:
        result = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not a JSON result file ({exc.msg})") from None
    if not isinstance(result, dict) or "output_throughput" not in result:
        raise ValueError(f"{file}: not a benchmark result (no output_throughput)")
    result.setdefault("label", result.get("model_id") or file.stem)
    result["source"] = str(file)
    return add_derived_figures(result)


def add_derived_figures(result: dict[str, Any]) -> dict[str, Any]:
    """Lift memory and KV figures to top-level keys the table shows, whatever their source.

    Offline results carry ``peak_memory_bytes``; serve results carry the server's
    ``/metrics`` figures under ``server_metrics``.
    """
    server = result.get("server_metrics") or {}
    memory_bytes = result.get("peak_memory_bytes") or server.get("peak_resident_memory_bytes")
    if memory_bytes:
        result.setdefault("peak_memory_gib", memory_bytes / 2**30)
    if server.get("peak_kv_cache_usage") is not None:
        result.setdefault("peak_kv_cache_usage_perc", server["peak_kv_cache_usage"] * 100)
    if server.get("num_preemptions") is not None:
        result.setdefault("num_preemptions", server["num_preemptions"])
    return result


def load_of(result: dict[str, Any]) -> tuple[str, float | None]:
    """The load a result was measured at: ``("concurrency", n)``, ``("request_rate", r)`` or none."""
    concurrency = result.get("max_concurrency")
    if concurrency:
        return "concurrency", float(concurrency)
    rate = result.get("request_rate")
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        return "request_rate", float(rate)
    return "unbounded", None


def value_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def num_rounds_of(result: dict[str, Any]) -> int:
    """Measured rounds behind a result's figures."""
    return max(len(round_values(result, "output_throughput")), 1)
