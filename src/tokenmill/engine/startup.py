"""What the engine reports once it is built: its first counters and the ready lines.

Kept apart from ``llm_engine.py`` so the step loop's module stays about the loop; nothing
here touches a worker.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.kv import KVCacheManager
from tokenmill.core.stats import EngineStats, StartupCosts
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu import cpu_info
from tokenmill.model.source import names_gguf

logger = logging.getLogger("tokenmill.engine.llm_engine")  # the engine's lines, one name


def initial_stats(
    config: EngineConfig, kv_manager: KVCacheManager, compile_time_s: float
) -> EngineStats:
    """The counters at start-up, with the precision and cache settings /metrics shows."""
    is_cpu = str(config.device).startswith("cpu")
    return EngineStats(
        compile_time_s=compile_time_s,
        kv_capacity_tokens=kv_manager.num_blocks * kv_manager.block_size,
        precision={
            "dtype": config.dtype,
            # vLLM's label for a GGUF file's own blocks (model/gguf_weights.py)
            "quantization": config.quantization or ("gguf" if names_gguf(config.model) else "none"),
            "kv_cache_dtype": config.kv_cache_dtype,
            "num_threads": str(config.num_threads) if is_cpu else "n/a",
            "cpu_isa": cpu_info().isa if is_cpu else "n/a",
            # the step budget resolved for the device (its default differs by device)
            "max_num_batched_tokens": str(config.max_num_batched_tokens),
        },
        cache_config={  # vLLM's CacheConfig names
            "block_size": str(kv_manager.block_size),
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(kv_manager.num_blocks),
            "num_cpu_blocks": "None",
            "prefix_caching_hash_algo": "sha256",
            "kv_cache": config.kv_cache,
        },
    )


def log_ready(
    config: EngineConfig,
    mc: ModelConfig,
    model_path: Path,
    kv_manager: KVCacheManager,
    kv_cache_bytes: int,
    startup: StartupCosts,
) -> None:
    """The two start-up lines: what was loaded where, and what each phase cost."""
    logger.info(
        "loaded %s (%s, %.1fM params) on %s in %s%s; KV (%s): %d tokens in %d blocks of %d (%.2f GiB); ready in %.1fs",
        model_path,
        mc.architecture,
        mc.num_params / 1e6,
        config.device,
        config.dtype,
        f", {config.quantization} weights" if config.quantization else "",
        config.kv_cache_dtype,
        kv_manager.num_blocks * kv_manager.block_size,
        kv_manager.num_blocks,
        kv_manager.block_size,
        kv_cache_bytes / 2**30,
        startup.total_s,
    )
    logger.info(
        "start-up costs: model load %.2fs, KV allocation %.2fs, compile %.2fs (%d buckets, cache %s)",
        startup.model_load_s,
        startup.kv_allocation_s,
        startup.compile_s,
        len(startup.compile_s_by_bucket),
        startup.compile_cache,
    )
