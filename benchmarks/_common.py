"""What the benchmark scripts share: random models saved once, servers started, waited for and
stopped, ``tokenmill bench serve`` runs, peak RSS of a server's process tree, timed offline
batches.

One copy of each, so that every script measures the same way: a server counts as ready when
its readiness path answers 200, its RSS includes the children it spawns (vLLM runs its engine
in a second process), and an offline batch is a list of random prompts submitted at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import psutil

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache/tokenmill"))
"""Where benchmark models are built once."""
PEERS_ROOT = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache/tokenmill-peers"))
"""Where ../shared/peers/ installs vLLM CPU and builds llama.cpp."""


def peers_dir() -> Path:
    """``shared/peers`` beside the checkout (or beside a parent of it), or $TOKENMILL_PEERS."""
    if "TOKENMILL_PEERS" in os.environ:
        return Path(os.environ["TOKENMILL_PEERS"])
    for parent in REPO.parents:
        if (parent / "shared" / "peers").is_dir():
            return parent / "shared" / "peers"
    return REPO.parent / "shared" / "peers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_random_model(folder: Path, make_config: Callable[[], Any], seed: int = 0) -> Path:
    """A transformers model with random weights (seeded) and the project's byte-level BPE
    tokenizer, saved once into ``folder`` (built beside it, then renamed, so a crash never
    leaves half a model)."""
    if (folder / "config.json").is_file():
        return folder
    import tokenmill  # noqa: I001, F401  (before torch: the OpenMP wait policy)
    import torch
    import transformers

    from tokenmill.model.demo import build_bpe_tokenizer

    torch.manual_seed(seed)
    tmp = folder.with_name(folder.name + ".tmp")
    transformers.AutoModelForCausalLM.from_config(make_config()).save_pretrained(tmp)
    build_bpe_tokenizer(tmp)
    tmp.rename(folder)
    return folder


def tokenmill_command(*args: str) -> list[str]:
    """``tokenmill ARGS`` with this interpreter (PYTHONPATH picks the source tree)."""
    return [sys.executable, "-m", "tokenmill.entrypoints.cli", *args]


def source_env(src: Path | None) -> dict[str, str]:
    """The environment that runs tokenmill from ``src`` (another worktree's src/), or as is."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


class RSSPoller:
    """Peak resident memory of a process and its children (summed), polled in a thread.

    ``mark()`` starts a second peak (e.g. from the first measured request), so a report can
    give both the whole life's peak (loading included) and the peak while serving.
    """

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak = 0
        self.peak_since_mark = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        total = 0
        try:
            procs = [self.process, *self.process.children(recursive=True)]
        except psutil.Error:
            return 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.rss()
            self.peak = max(self.peak, rss)
            self.peak_since_mark = max(self.peak_since_mark, rss)
            self._stop.wait(self.interval_s)

    def mark(self) -> None:
        self.peak_since_mark = 0

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def wait_ready(
    base_url: str,
    proc: subprocess.Popen[bytes],
    timeout_s: float = 600,
    path: str = "/health",
) -> None:
    """Poll ``base_url + path`` until it answers 200; fail early if the server exits.

    ``/health``, not ``/v1/models``: tokenmill answers HTTP (and lists its model) while the
    model still loads, and says 503 on ``/health`` until it is ready, as llama.cpp does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} did not become ready in {timeout_s:.0f} s")


class Server:
    """A server process, started in its own session, ready on entry, stopped on exit.

    Its output goes to ``log`` (or nowhere). Stopping sends SIGTERM to the whole process
    group (vLLM's engine process included), then SIGKILL after ``stop_timeout_s``.
    """

    def __init__(
        self,
        command: Sequence[str],
        base_url: str,
        *,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        ready_path: str = "/health",
        ready_timeout_s: float = 600,
        stop_timeout_s: float = 60,
        poll_rss: bool = False,
    ) -> None:
        self.command = list(command)
        self.base_url = base_url
        self.log = log
        self.env = env
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_rss = poll_rss
        self.proc: subprocess.Popen[bytes] | None = None
        self.rss: RSSPoller | None = None
        self.ready_s = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Server:
        out = self.log.open("wb") if self.log else subprocess.DEVNULL
        start = time.monotonic()
        self.proc = subprocess.Popen(
            self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        if self.log:
            out.close()  # type: ignore[union-attr]
        if self.poll_rss:
            self.rss = RSSPoller(self.proc.pid)
        try:
            wait_ready(self.base_url, self.proc, self.ready_timeout_s, self.ready_path)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - start
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 15) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def bench_serve(
    base_url: str,
    out: Path,
    *,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    tokenizer: Path | None = None,
    num_warmups: int = 1,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One ``tokenmill bench serve`` run (random prompts, greedy, EOS ignored); its summary."""
    command = tokenmill_command(
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--dataset",
        "random",
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--ignore-eos",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--num-warmups",
        str(num_warmups),
        "--no-progress",
        "--save-result",
        str(out),
        *(["--tokenizer", str(tokenizer)] if tokenizer else []),
        *extra,
    )
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.decode(errors="replace").splitlines()[-10:])
        raise RuntimeError(f"bench serve exited with {done.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def warm_up(llm: LLM, num_requests: int = 1, **generate_kwargs: Any) -> None:
    """Short requests (8 -> 2 tokens), so the first measured batch does not pay for
    first-call setup (e.g. LoRA adapters loaded into their slots: one request per adapter)."""
    from tokenmill.core.sampling_params import SamplingParams

    prompts = [[5 + i] * 8 for i in range(num_requests)]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, **generate_kwargs)


def timed_batch(
    llm: LLM,
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
    **generate_kwargs: Any,
) -> tuple[dict[str, float], list[list[int]]]:
    """``num_requests`` random prompts submitted at once, greedy, EOS ignored: output tok/s,
    wall seconds, and each request's tokens."""
    from tokenmill.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **generate_kwargs)
    wall_s = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall_s, "output_tok_s": sum(map(len, tokens)) / wall_s}, tokens
