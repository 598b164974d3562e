"""The uvicorn server both HTTP front doors run: the single server and the data-parallel one.

One place for the signal handling they share: the first SIGTERM starts ``drain`` on the
event loop with ``--shutdown-timeout``, SIGINT (Ctrl-C) starts it with no wait, and a second
signal forces uvicorn out. What draining means (refusing new requests, waiting for the
in-flight ones, cutting off the rest) is each server's own ``drain``. Kept apart from
``server.py`` so the data-parallel front end, which loads no engine, need not import it.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT runs ``drain`` instead of exiting at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_drain_started = False

    @property
    def shutdown_timeout_s(self) -> float:
        """How long a SIGTERM drain lets in-flight requests finish (``--shutdown-timeout``)."""
        raise NotImplementedError

    async def drain(self, timeout_s: float) -> None:
        """Wind down for up to ``timeout_s`` (0 after SIGINT), then set ``should_exit``."""
        self.should_exit = True

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM drains for ``--shutdown-timeout``; SIGINT (Ctrl-C) cuts off at once; a second signal forces."""
        if (
            sig in (signal.SIGTERM, signal.SIGINT)
            and not self._is_drain_started
            and self._loop is not None
        ):
            self._is_drain_started = True
            timeout_s = self.shutdown_timeout_s if sig == signal.SIGTERM else 0.0
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain(timeout_s)))
            return
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
