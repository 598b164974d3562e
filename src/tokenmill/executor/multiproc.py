"""MultiprocExecutor: one worker process per tensor-parallel rank, supervised by the engine.

Each rank is a spawned process holding a ``Worker``; the engine talks to it over a pipe
with msgpack frames (``core/messages.py``), never pickle: a call is ``[method, args]``, an
answer ``[ok, result]`` (``result`` an error text when not ok). A step's plan is encoded
once and the same bytes go to every rank; rank 0 answers with the sampled tokens, the
others with nil. Ranks talk to each other through ``torch.distributed`` (gloo on CPU, NCCL
on CUDA) for the all-reduces of the tensor-parallel layers.

Supervision: every wait for an answer also watches each process's sentinel, so a rank that
exits (killed, crashed, out of memory) raises ``WorkerDiedError`` naming it instead of
leaving the engine waiting; the engine then fails its requests and the server goes 503.
A worker whose engine went away sees its pipe close and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.core.messages import (
    StepOutput,
    StepPlan,
    decode_any,
    decode_output,
    encode,
    plan_for_wire,
)
from tokenmill.executor.base import Executor, WorkerDiedError
from tokenmill.resolved_model import ResolvedModel

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest a rank may take to load its shard and answer (a big model from a slow disk)."""
_DEATH_GRACE_S = 2.0
"""After a failed answer, how long to look for the rank that actually died."""


def config_to_wire(config: EngineConfig) -> bytes:
    return encode({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def config_from_wire(data: bytes) -> EngineConfig:
    values = decode_any(data)
    if values.get("compile_batch_sizes") is not None:
        values["compile_batch_sizes"] = tuple(values["compile_batch_sizes"])
    return EngineConfig(**values)


class MultiprocExecutor(Executor):
    """``tensor_parallel_size`` worker processes on this machine."""

    is_in_process = False

    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.world_size = config.tensor_parallel_size
        # A rendezvous file in a private folder: a free TCP port picked here could be taken
        # by another replica's group starting at the same moment (-dp N -tp M).
        self._rendezvous = tempfile.mkdtemp(prefix="tokenmill-tp-")
        init_method = f"file://{os.path.join(self._rendezvous, 'store')}"
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        self._closed = False
        wire = config_to_wire(config)
        model_wire = resolved.to_wire()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, wire, model_wire, child, init_method),
                name=f"tokenmill-tp{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs, self._rendezvous)
        try:
            for rank in range(self.world_size):
                self._answer(rank, timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d worker processes ready (pids %s)",
            self.world_size,
            ", ".join(str(p.pid) for p in self._procs),
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid or 0 for p in self._procs]

    # ---- calls ---------------------------------------------------------------------
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), result_type: Any = Any
    ) -> list[Any]:
        self._send_all(encode([method, encode(list(args))]))
        return [
            msgspec.convert(decode_any(answer), result_type, strict=False)
            for answer in self._answers()
        ]

    def execute_model(self, plan: StepPlan) -> StepOutput:
        self._send_all(encode(["execute_model", encode(plan_for_wire(plan))]))
        answers = self._answers()
        out = decode_output(answers[0])
        assert out is not None
        return out

    def check_health(self) -> None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise WorkerDiedError(rank, f"exit code {proc.exitcode}")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    # ---- pipes -----------------------------------------------------------------------
    def _send_all(self, frame: bytes) -> None:
        if self._closed:
            raise RuntimeError("the executor was shut down")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(frame)
            except OSError as exc:
                raise self._died(rank, f"its pipe is closed ({exc})") from None

    def _answers(self) -> list[bytes]:
        """Every rank's answer to one call. A rank that answered an error is raised only after
        the others' answers are read, so no stale answer is left in a pipe for the next call."""
        answers: list[bytes] = []
        failure: RuntimeError | None = None
        for rank in range(self.world_size):
            try:
                answers.append(self._answer(rank))
            except WorkerDiedError:
                raise
            except RuntimeError as exc:
                failure = failure or exc
                answers.append(b"")
        if failure is not None:
            raise failure
        return answers

    def _answer(self, rank: int, timeout_s: float | None = None) -> bytes:
        """Rank ``rank``'s next answer; WorkerDiedError as soon as any rank is gone."""
        conn = self._conns[rank]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([conn, *(p.sentinel for p in self._procs)], timeout=remaining)
            if conn in ready:
                try:
                    ok, result = decode_any(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._died(rank, "its pipe closed") from None
                if not ok:
                    raise self._died(rank, result, is_error_answer=True)
                return bytes(result) if isinstance(result, (bytes, bytearray)) else encode(result)
            for r, proc in enumerate(self._procs):
                if proc.sentinel in ready:  # that process exited
                    proc.join(timeout=_DEATH_GRACE_S)  # its exit code, once it is reaped
                    raise WorkerDiedError(r, f"process {proc.pid} exited with code {proc.exitcode}")
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkerDiedError(rank, f"no answer within {timeout_s:.0f}s")

    def _died(self, rank: int, detail: str, is_error_answer: bool = False) -> Exception:
        """The error to raise: naming a rank that exited if there is one (a rank's collective
        fails when its peer dies, so the first error seen is often not the cause)."""
        # One rank has no peer whose death could have caused its error: no grace to wait.
        grace = _DEATH_GRACE_S if self.world_size > 1 else 0.0
        deadline = time.monotonic() + grace
        while True:
            for r, proc in enumerate(self._procs):
                # The rank that answered an error is alive: only another rank's exit is a cause.
                if proc.exitcode is not None and not (is_error_answer and r == rank):
                    return WorkerDiedError(
                        r, f"process {proc.pid} exited with code {proc.exitcode}"
                    )
            if time.monotonic() >= deadline or not is_error_answer:
                break
            time.sleep(0.05)
        if is_error_answer:
            return RuntimeError(f"tensor-parallel rank {rank} failed: {detail}")
        return WorkerDiedError(rank, detail)


def _stop(conns: list[Connection], procs: list[BaseProcess], rendezvous: str) -> None:
    """Ask every worker to exit, then make sure: terminate, then kill what is left."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(encode(["shutdown", encode([])]))
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(rendezvous, ignore_errors=True)


# ---- the worker process ---------------------------------------------------------------
def _arg_types() -> dict[str, tuple[Any, ...]]:
    """Argument types of the calls a worker answers, for decoding them back into objects."""
    from tokenmill.core.messages import KVCacheSpec
    from tokenmill.lora_request import LoRARequest

    return {"initialize_cache": (KVCacheSpec,), "add_lora": (LoRARequest, set[int])}


def _worker_main(
    rank: int,
    world_size: int,
    config_wire: bytes,
    model_wire: bytes,
    conn: Connection,
    init_method: str,
) -> None:
    """A rank's process: join the process group, load the shard, answer calls until told to
    stop or until the engine's end of the pipe closes."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s: %(message)s")

    def answer(ok: bool, result: Any) -> None:
        conn.send_bytes(encode([ok, result]))

    try:
        from tokenmill.worker.parallel import init_distributed
        from tokenmill.worker.worker import Worker

        config = config_from_wire(config_wire)
        init_distributed(config, rank, world_size, init_method)
        worker = Worker(config, ResolvedModel.from_wire(model_wire), rank, world_size)
        arg_types = _arg_types()
        answer(True, None)
    except BaseException as exc:  # reported to the engine, which names this rank
        logger.exception("rank %d failed to start", rank)
        answer(False, f"{type(exc).__name__}: {exc}")
        return
    from tokenmill.core.messages import decode_plan

    while True:
        try:
            method, raw = decode_any(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine is gone
        if method == "shutdown":
            answer(True, None)
            return
        try:
            if method == "execute_model":
                out = worker.execute_model(decode_plan(raw))
                answer(True, encode(out if rank == 0 else None))
                continue
            args = decode_any(raw)
            types = arg_types.get(method, ())
            args = [
                msgspec.convert(a, t, strict=False) if i < len(types) else a
                for i, (a, t) in enumerate(zip(args, [*types, *[Any] * len(args)], strict=False))
            ]
            answer(True, encode(getattr(worker, method)(*args)))
        except Exception as exc:
            logger.exception("rank %d: %s failed", rank, method)
            answer(False, f"{type(exc).__name__}: {exc}")
