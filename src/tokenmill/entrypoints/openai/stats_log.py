"""The periodic stats line vLLM logs (``--disable-log-stats`` turns it off).

Every ``--log-stats-interval`` seconds: prompt and generation throughput over the interval,
requests running and waiting, KV cache usage and the prefix cache hit rate, read from the
engine's published ``EngineStats``. Logged at info while the engine is busy and at debug
when nothing happened, so an idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tokenmill.core.stats import EngineStats
from tokenmill.entrypoints.openai.state import ServerState

logger = logging.getLogger("tokenmill.stats")


def stats_line(previous: EngineStats, current: EngineStats, interval_s: float) -> tuple[str, bool]:
    """The line for one interval, and whether anything happened in it."""
    prompt = current.num_prompt_tokens - previous.num_prompt_tokens
    generation = current.num_generation_tokens - previous.num_generation_tokens
    queries = current.num_prefix_query_tokens - previous.num_prefix_query_tokens
    hits = current.num_prefix_hit_tokens - previous.num_prefix_hit_tokens
    line = (
        f"Avg prompt throughput: {prompt / interval_s:.1f} tokens/s, "
        f"Avg generation throughput: {generation / interval_s:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, Waiting: {current.num_waiting} reqs, "
        f"KV cache usage: {current.kv_usage * 100:.1f}%, "
        f"Prefix cache hit rate: {(hits / queries * 100) if queries else 0.0:.1f}%"
    )
    is_busy = bool(prompt or generation or current.num_running or current.num_waiting)
    return line, is_busy


async def log_stats_periodically(state: ServerState, interval_s: float) -> None:
    """Log ``stats_line`` every ``interval_s`` until cancelled."""
    previous = state.engine.stats or EngineStats()
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        current = state.engine.stats or EngineStats()
        now = time.monotonic()
        line, is_busy = stats_line(previous, current, max(now - last, 1e-9))
        logger.log(logging.INFO if is_busy else logging.DEBUG, "%s", line)
        previous, last = current, now
