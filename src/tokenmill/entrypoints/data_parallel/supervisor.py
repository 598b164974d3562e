"""Replica processes: started, watched and restarted by the front end's supervisor.

Each replica is a plain ``tokenmill serve`` (the same parsed flags) listening on a unix
socket in a private directory, so no port is taken and nothing outside this machine's user
can reach it unauthenticated. Replicas are spawned (never forked from a process holding
threads) and are not daemonic, so a replica may start its own worker processes; each one
exits by itself when the front end goes away. The supervisor checks every replica each
``--dp-health-interval``: a dead process is restarted (after a back-off that grows with
consecutive failures), a replica whose ``/health`` is not 200 takes no new requests. A
request that cannot connect to a replica wakes the supervisor at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import httpx

logger = logging.getLogger(__name__)

STARTING_POLL_S = 0.2
"""How often replicas are checked while one is starting (then: ``--dp-health-interval``)."""


def replica_args(args: argparse.Namespace, index: int, socket_path: str) -> argparse.Namespace:
    """The flags one replica serves with: the front end's, on a private socket, one replica."""
    out = copy.copy(args)
    out.data_parallel_size = 1
    out.uds = socket_path
    out.api_keys = []  # the front end authenticates; the socket is private
    out.per_key_max_concurrency = None
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if hasattr(out, name):
            setattr(out, name, None)
    out.allowed_origins = ()  # CORS is the front end's
    if getattr(args, "num_threads", None) is None:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        # Each replica's tensor-parallel workers take their own share.
        tp = max(1, getattr(args, "tensor_parallel_size", None) or 1)
        out.num_threads = max(1, cores // (args.data_parallel_size * tp))
    quiet = "/health,/metrics"  # the supervisor's and front end's own polls
    given = getattr(args, "disable_access_log_for_endpoints", None)
    out.disable_access_log_for_endpoints = f"{given},{quiet}" if given else quiet
    out.func = None
    return out


def run_replica(args: argparse.Namespace, index: int, parent_pid: int) -> None:
    """A replica process's main: serve until told to stop or until the front end is gone."""
    logging.basicConfig(
        level=getattr(logging, (getattr(args, "serve_log_level", None) or "info").upper()),
        format=f"%(asctime)s %(levelname)s [replica {index}] %(name)s: %(message)s",
    )

    def watch_parent() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    os.environ.pop("TOKENMILL_API_KEY", None)  # the front end authenticates
    threading.Thread(target=watch_parent, daemon=True, name="tokenmill-parent-watch").start()
    from tokenmill.entrypoints.cli import serve_model
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.openai.server import run_server

    sys.exit(run_server(args, engine_config_from_args(args, serve_model(args))))


@dataclass
class Replica:
    """One replica: its process, its socket and client, and what the supervisor knows."""

    index: int
    socket_path: str
    client: httpx.AsyncClient
    process: BaseProcess | None = None
    is_ready: bool = False
    num_restarts: int = 0
    consecutive_failures: int = 0
    restart_at: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)


class ReplicaSupervisor:
    """Starts the replicas, and keeps them running: restart on exit, ready on ``/health`` 200."""

    def __init__(
        self,
        args: argparse.Namespace,
        socket_dir: str,
        health_interval_s: float,
        on_ready: Callable[[int], None],
        on_down: Callable[[int], None],
        prepare: Callable[[Replica], Awaitable[bool]] | None = None,
        max_connections: int = 64,
    ) -> None:
        self.args = args
        self.health_interval_s = health_interval_s
        self.health_timeout_s: float = args.dp_health_timeout
        self.max_restart_backoff_s: float = args.dp_max_restart_backoff
        self.on_ready = on_ready
        self.on_down = on_down
        self.prepare = prepare
        """Run on a healthy replica before it is marked ready (False: not yet)."""
        self._ctx = multiprocessing.get_context("spawn")
        self.replicas = []
        for i in range(args.data_parallel_size):
            path = os.path.join(socket_dir, f"replica-{i}.sock")
            client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=path),
                base_url="http://replica",
                timeout=httpx.Timeout(None, connect=self.health_timeout_s),
                # As many kept-alive connections as the replica admits requests.
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=max(1, max_connections)
                ),
            )
            self.replicas.append(Replica(i, path, client))
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._is_stopping = False
        self._signalled: set[int | None] = set()

    def start(self) -> None:
        for replica in self.replicas:
            self._spawn(replica)
        self._task = asyncio.ensure_future(self._watch())

    def _spawn(self, replica: Replica) -> None:
        if os.path.exists(replica.socket_path):
            os.unlink(replica.socket_path)
        process = self._ctx.Process(
            target=run_replica,
            args=(
                replica_args(self.args, replica.index, replica.socket_path),
                replica.index,
                os.getpid(),
            ),
            name=f"tokenmill-replica-{replica.index}",
        )
        process.start()
        replica.process = process
        logger.info("replica %d started (pid %s)", replica.index, process.pid)

    async def _watch(self) -> None:
        while not self._is_stopping:
            await asyncio.gather(*(self._check_logged(r) for r in self.replicas))
            all_ready = all(r.is_ready for r in self.replicas)
            interval = (
                self.health_interval_s
                if all_ready
                else min(STARTING_POLL_S, self.health_interval_s)
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()

    async def _check_logged(self, replica: Replica) -> None:
        """``_check``; an unexpected error is logged and the loop goes on (a dead loop would
        leave every replica unwatched, and nothing would say so)."""
        try:
            await self._check(replica)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("replica %d: the supervisor's check failed", replica.index)

    async def _check(self, replica: Replica) -> None:
        process = replica.process
        if process is None:  # waiting out its back-off
            if time.monotonic() >= replica.restart_at and not self._is_stopping:
                replica.num_restarts += 1
                self._spawn(replica)
            return
        if process.exitcode is not None:
            replica.exit_codes.append(process.exitcode)
            process.close()
            replica.process = None
            self._set_ready(replica, False)
            replica.consecutive_failures += 1
            backoff = min(self.max_restart_backoff_s, 0.5 * 2 ** (replica.consecutive_failures - 1))
            replica.restart_at = time.monotonic() + backoff
            logger.error(
                "replica %d exited (code %s); restarting it in %.1fs",
                replica.index,
                replica.exit_codes[-1],
                backoff,
            )
            return
        try:
            response = await replica.client.get("/health", timeout=self.health_timeout_s)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            replica.consecutive_failures = 0
            if not replica.is_ready and self.prepare is not None:
                healthy = await self.prepare(replica)
        self._set_ready(replica, healthy)

    def _set_ready(self, replica: Replica, is_ready: bool) -> None:
        if is_ready == replica.is_ready:
            return
        replica.is_ready = is_ready
        if is_ready:
            logger.info("replica %d is ready", replica.index)
            self.on_ready(replica.index)
        else:
            self.on_down(replica.index)

    def mark_unreachable(self, index: int) -> None:
        """A request could not connect: take no more requests until ``/health`` says 200,
        and check it now (it has likely died: restart it without waiting for the next check)."""
        self._set_ready(self.replicas[index], False)
        self._wake.set()

    def terminate(self, sigint: bool = False) -> None:
        """Start stopping: no more restarts, SIGTERM (or SIGINT: no drain) to every replica."""
        self._is_stopping = True
        for replica in self.replicas:
            process = replica.process
            if process is not None and process.exitcode is None and process.pid is not None:
                self._signalled.add(process.pid)  # a second signal would force it: no drain
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGINT if sigint else signal.SIGTERM)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every replica (they drain), SIGKILL those still running after ``timeout_s``."""
        self._is_stopping = True
        if self._task is not None:
            self._task.cancel()
        processes = [r.process for r in self.replicas if r.process is not None]
        for process in processes:
            if process.exitcode is None and process.pid not in self._signalled:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        for replica in self.replicas:
            await replica.client.aclose()

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.index,
                "pid": r.process.pid if r.process is not None else None,
                "ready": r.is_ready,
                "restarts": r.num_restarts,
            }
            for r in self.replicas
        ]
