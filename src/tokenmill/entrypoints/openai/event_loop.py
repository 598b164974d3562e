"""The server's event loop: asyncio's, with an ``accept()`` that backs off when out of fds.

When ``accept()`` fails for lack of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM), asyncio
pauses the listening socket for a second, but (CPython 3.11) its loop goes on calling
``accept()`` up to ``backlog`` (uvicorn: 2048) times, logging a traceback and scheduling
another restart each time: ~10,000 log lines a second that go on after the burst. Taking
one connection per wake-up keeps the pause to one failure and one restart; the selector
wakes the loop again at once while more connections wait, so accepting is not slower.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

ACCEPTS_PER_WAKEUP = 1


class BackoffEventLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop, whose accept pauses once per failure instead of spinning."""

    def _accept_connection(
        self,
        protocol_factory: Any,
        sock: Any,
        sslcontext: Any = None,
        server: Any = None,
        backlog: int = 100,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super()._accept_connection(  # type: ignore[misc]
            protocol_factory,
            sock,
            sslcontext,
            server,
            min(backlog, ACCEPTS_PER_WAKEUP),
            *args,
            **kwargs,
        )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvicorn's ``loop`` factory (``Config(loop="...event_loop:new_event_loop")``)."""
    return BackoffEventLoop(selectors.DefaultSelector())
