"""EngineStats: the engine's counters and gauges, shared with metrics exporters (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


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
