"""Engine CLI flags: one flag per EngineConfig field, with vLLM's names."""

from __future__ import annotations

import argparse
import re
from typing import Any

from tokenmill.config import EngineConfig

_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_memory(text: str) -> float:
    """``0.3`` (fraction of free memory), ``4GiB``, ``512MiB``, ``2G`` or plain bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid memory size {text!r}: use a fraction like 0.3 or a size like 4GiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError("memory size must be positive")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/activations dtype (auto: checkpoint's, float32 on CPU)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--kv-cache", default="paged", choices=["paged", "static"], help="KV memory strategy")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged)")
    g.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                   help="KV budget: a fraction of free memory (0.3) or a size (4GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: fraction of GPU memory for weights + KV")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV of shared prompt prefixes")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="order of waiting requests: arrival, or the request's priority (lower first)")
    g.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs a request may ask for")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's global generator")
    g.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graph capture")
    g.add_argument("--compile-batch-sizes", type=_int_list, default=None,
                   help="static: decode batch sizes to compile, e.g. 1,2,4,8 (default: powers of two)")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Map parsed flags 1:1 onto EngineConfig."""
    kwargs: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "dtype", "device", "kv_cache", "block_size", "kv_cache_memory", "gpu_memory_utilization",
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
            "scheduling_policy", "max_logprobs", "seed", "enforce_eager", "compile_batch_sizes", "num_threads",
        )
    }
    return EngineConfig(model=model, **kwargs)
