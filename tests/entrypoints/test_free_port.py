"""``free_port``: the ports server tests start on stay out of the kernel's ephemeral range.

A port from ``bind(0)`` can be handed to another process's socket between the probe and the
server's own bind; Ray Serve's proxy lost such a race in CI.
"""

from __future__ import annotations

import socket

from tests.entrypoints.conftest import _QUIET_PORTS, _ephemeral_range, free_port


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        assert not low <= port <= high
        assert _QUIET_PORTS[0] <= port < _QUIET_PORTS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned


def test_a_port_in_use_is_never_returned() -> None:
    held = []
    try:
        for _ in range(10):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(free_port() not in taken for _ in range(50))
    finally:
        for s in held:
            s.close()
