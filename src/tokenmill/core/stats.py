"""EngineStats: the engine's counters and gauges, shared with metrics exporters (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters and gauges for metrics; cumulative unless said otherwise."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_steps: int = 0
    compile_time_s: float = 0.0
    """Start-up time spent compiling / capturing the decode step (static strategy)."""
    kv_capacity_tokens: int = 0
    """Token slots in the KV pool, allocated at start-up (gauge)."""
    kv_reserved_tokens: int = 0
    """Token slots committed to live requests after the latest step (gauge)."""
    kv_used_tokens: int = 0
    """Of those, slots holding a token's K/V (gauge)."""
    kv_reserved_token_steps: int = 0
    """``kv_reserved_tokens`` summed over steps: with the next, a step-averaged KV waste."""
    kv_used_token_steps: int = 0
    precision: dict[str, str] = field(default_factory=dict)
    """What runs, fixed at start-up: dtype, quantization, kv_cache_dtype, num_threads, cpu_isa."""

    @property
    def kv_waste(self) -> float | None:
        """Reserved but empty KV slots over reserved, averaged over steps (None before any)."""
        if not self.kv_reserved_token_steps:
            return None
        return 1.0 - self.kv_used_token_steps / self.kv_reserved_token_steps
