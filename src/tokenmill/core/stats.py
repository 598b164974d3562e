"""EngineStats: the engine's counters and gauges, shared with metrics exporters (no torch)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
"""vLLM's ``iteration_tokens_total`` buckets: tokens scheduled in one engine step."""


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
    kv_cache_resident_bytes: int = 0
    """Bytes of the KV pool resident in memory now, summed over ranks (gauge): its mapping
    fills as blocks are first used, so this grows up to the pool's size and then stays."""
    kv_reserved_tokens: int = 0
    """Token slots committed to live requests after the latest step (gauge)."""
    kv_used_tokens: int = 0
    """Of those, slots holding a token's K/V (gauge)."""
    kv_reserved_token_steps: int = 0
    """``kv_reserved_tokens`` summed over steps: with the next, a step-averaged KV waste."""
    kv_used_token_steps: int = 0
    moe_tokens_per_expert: list[list[int]] = field(default_factory=list)
    """Mixture-of-experts models: tokens routed to each expert, per sparse layer."""
    precision: dict[str, str] = field(default_factory=dict)
    """What runs, fixed at start-up: dtype, quantization, kv_cache_dtype, num_threads, cpu_isa."""
    cache_config: dict[str, str] = field(default_factory=dict)
    """The KV cache's configuration, fixed at start-up (vLLM's ``cache_config_info`` labels)."""
    iteration_token_counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
    """Engine steps by tokens scheduled, per ``ITERATION_TOKENS_BUCKETS`` bucket (+ overflow)."""
    iteration_tokens_sum: int = 0

    def observe_iteration(self, num_tokens: int) -> None:
        """Count one step of ``num_tokens`` (a new tuple: copies handed out stay unchanged)."""
        index = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)
        counts = list(self.iteration_token_counts)
        counts[index] += 1
        self.iteration_token_counts = tuple(counts)
        self.iteration_tokens_sum += num_tokens

    spec_num_drafts: int = 0
    """Speculative decoding: requests that verified draft tokens, counted once per step."""
    spec_num_draft_tokens: int = 0
    """Draft tokens verified."""
    spec_num_accepted_tokens: int = 0
    """Of those, tokens accepted."""
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    """Accepted draft tokens by position in the draft (0 first)."""

    spec_policy_steps: dict[int, int] = field(default_factory=dict)
    """Steps by the number of tokens the batch-size policy let each request propose (0:
    speculation off for that step's batch); only steps with running requests count."""

    spec_num_draft_model_steps: int = 0
    """Draft model: engine steps in which it ran (read a lag, drafted); none while the
    policy keeps speculation off."""
    spec_num_draft_model_tokens: int = 0
    """Draft model: tokens it computed (catch-up plus draft inputs), charged to the budget."""

    def record_draft_model_step(self, num_tokens: int) -> None:
        self.spec_num_draft_model_steps += 1
        self.spec_num_draft_model_tokens += num_tokens

    def record_speculation(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification in one step."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        if len(self.spec_accepted_per_pos) < num_draft_tokens:
            self.spec_accepted_per_pos.extend(
                [0] * (num_draft_tokens - len(self.spec_accepted_per_pos))
            )
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens produced per verifying step of a request: accepted drafts plus one."""
        if not self.spec_num_drafts:
            return None
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def kv_waste(self) -> float | None:
        """Reserved but empty KV slots over reserved, averaged over steps (None before any)."""
        if not self.kv_reserved_token_steps:
            return None
        return 1.0 - self.kv_used_token_steps / self.kv_reserved_token_steps


@dataclass
class StartupCosts:
    """What one engine start cost, per phase, so cold and warm starts can be told apart."""

    model_load_s: float = 0.0
    """Reading config, tokenizer and weights onto the device."""
    kv_allocation_s: float = 0.0
    """Sizing and zero-filling the KV cache tensors."""
    compile_s_by_bucket: dict[int, float] = field(default_factory=dict)
    """Decode batch size -> seconds to compile (and capture) it; empty when nothing compiles."""
    compile_cache_by_bucket: dict[int, str] = field(default_factory=dict)
    """Decode batch size -> ``warm`` (inductor's cache had it), ``cold`` or ``unknown``."""
    total_s: float = 0.0
    """The whole engine construction, wall clock."""

    @property
    def compile_s(self) -> float:
        return sum(self.compile_s_by_bucket.values())

    @property
    def compile_cache(self) -> str:
        """``warm`` when every bucket hit the cache, ``cold`` when any compiled from scratch,
        ``none`` when nothing was compiled, else ``unknown``."""
        states = set(self.compile_cache_by_bucket.values())
        if not states:
            return "none"
        if "cold" in states:
            return "cold"
        return "warm" if states == {"warm"} else "unknown"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready figures for bench reports."""
        return {
            "model_load_s": self.model_load_s,
            "kv_allocation_s": self.kv_allocation_s,
            "compile_s": self.compile_s,
            "compile_cache": self.compile_cache,
            "compile_s_by_bucket": {str(b): s for b, s in self.compile_s_by_bucket.items()},
            "startup_s": self.total_s,
        }
