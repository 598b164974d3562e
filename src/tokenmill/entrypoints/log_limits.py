"""Rate limiting of repeated identical log records, so one fault cannot flood the log.

A record (warning or worse) that repeats the same logger, level and message more than
``burst`` times within ``window_s`` is held back; the first one through after the window
says how many were held back. Info lines (the access log) are never held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_BURST = 5
DEFAULT_WINDOW_S = 10.0
MAX_TRACKED = 1024
"""Distinct messages remembered at once; the oldest window is dropped beyond it."""


@dataclass
class _Seen:
    window_start: float
    num_in_window: int = 0
    num_held_back: int = 0


class RepeatedRecordFilter(logging.Filter):
    """Let ``burst`` identical records through per ``window_s``; count and summarise the rest."""

    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple[str, int, str], _Seen] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None or now - seen.window_start >= self.window_s:
                held_back = seen.num_held_back if seen is not None else 0
                if seen is None and len(self._seen) >= MAX_TRACKED:
                    del self._seen[min(self._seen, key=lambda k: self._seen[k].window_start)]
                seen = self._seen[key] = _Seen(window_start=now)
                if held_back:
                    record.msg = (
                        f"{record.msg} [and {held_back} more like it, held back, in the last "
                        f"{self.window_s:.0f}s]"
                    )
            seen.num_in_window += 1
            if seen.num_in_window > self.burst:
                seen.num_held_back += 1
                return False
            return True


_LIMITER = RepeatedRecordFilter()


def install_log_rate_limit(*logger_names: str, root: bool = False) -> None:
    """Put the process's RepeatedRecordFilter on every handler of the named loggers
    (uvicorn's own do not propagate to the root) and, with ``root``, of the root logger;
    idempotent. Only handlers tokenmill set up are filtered: an embedding program's (or a
    test runner's) root handlers are left alone."""
    for name in ("", *logger_names) if root else logger_names:
        for handler in logging.getLogger(name or None).handlers:
            if _LIMITER not in handler.filters:
                handler.addFilter(_LIMITER)
