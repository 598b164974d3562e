"""``tokenmill plan``: will this model serve C requests of N tokens on this much memory?

"Estimate KV memory before you deploy: multiply concurrency by the maximum context." The
planner does that with the engine's own sizing code, so its figures are what the engine
allocates: weight bytes and KV bytes per token from ``model/sizing.py``, the KV budget from
the same formula the engine applies on a GPU after loading the weights, and the pool from
the KV strategy's own ``for_budget`` (``core/kv``). It reads only ``config.json``: no
weights are loaded and torch is not imported.

By default it answers for the machine it runs on: a GPU's memory where ``nvidia-smi`` reports
one, else this machine's available memory (within a cgroup's limit), and the dtype ``serve``
would pick there (``model/cpu_dtype.py`` on a CPU; the checkpoint's on a GPU).

Paged KV holds what requests actually use, so the planner shows the expected pool (every
request at ``--mean-seq-len`` tokens) next to the worst case (every request at
``--max-model-len``); static KV reserves the worst case up front.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from tokenmill.core.kv import STRATEGIES, KVSizing, build_kv_manager
from tokenmill.entrypoints.config_args import parse_memory
from tokenmill.errors import ConfigError
from tokenmill.model import sizing
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu_dtype import cpu_auto_dtype, cpu_flags
from tokenmill.model.source import resolve_model_path


@dataclass(frozen=True)
class Machine:
    """Where the plan is for: the device and its memory, and where that figure came from."""

    device: str
    memory_bytes: int
    source: str


def _cgroup_memory_limit() -> int | None:
    """The cgroup (v2, else v1) memory limit of this process, if it has one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def _gpu_memory_bytes() -> int | None:
    """The first GPU's total memory from ``nvidia-smi`` (None without one); no torch import."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def this_machine(device: str = "auto") -> Machine:
    """The device ``serve`` would use here and its memory."""
    gpu = _gpu_memory_bytes() if device in ("auto", "cuda") else None
    if gpu is not None:
        return Machine("cuda", gpu, "this machine's GPU (nvidia-smi)")
    if device == "cuda":
        raise ConfigError("--device cuda: no GPU found (nvidia-smi); give --memory")
    available = psutil.virtual_memory().available
    limit = _cgroup_memory_limit()
    if limit is not None and limit < available:
        return Machine("cpu", limit, "this process's cgroup memory limit")
    return Machine("cpu", available, f"this machine's available memory ({os.cpu_count()} CPUs)")


@dataclass(frozen=True)
class PlanInputs:
    """What the planner is asked: the model, the load, and the device."""

    model: str
    max_model_len: int
    concurrency: int
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantization_group_size: int = sizing.INT4_GROUP_SIZE
    kv_cache: str = "paged"
    block_size: int = 16
    memory_bytes: int | None = None
    """Device memory; None: this machine's (``this_machine``)."""
    device: str = "auto"
    """``cpu``, ``cuda``, or ``auto``: a GPU where one is found, else the CPU."""
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None
    mean_seq_len: int | None = None
    """Expected tokens per request for the paged estimate; default half of max_model_len."""


@dataclass
class CapacityPlan:
    """The planner's answer; every size in bytes, every length in tokens."""

    model: str
    dtype: str
    kv_cache_dtype: str
    kv_cache: str
    device: str
    memory_bytes: int
    memory_source: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    num_blocks: int
    """Blocks the engine would allocate for this load (0 when it cannot start)."""
    kv_pool_bytes: int
    """What the engine allocates for KV: ``num_blocks`` plus its one scratch block."""
    worst_case_bytes: int
    """Every request at max_model_len (static: what it reserves)."""
    expected_bytes: int
    """Every request at mean_seq_len (paged); equals the worst case for static."""
    fits: bool
    """Whether the worst case fits the budget (paged may still run with less, by waiting)."""
    fits_expected: bool
    max_concurrency: int
    """Most requests of max_model_len tokens the budget holds at once."""
    max_context: int
    """Longest context every one of ``concurrency`` requests can have at once."""
    concurrency: int
    max_model_len: int
    mean_seq_len: int
    error: str | None = None
    """Why the engine would refuse to start (static: the reservation does not fit)."""

    def lines(self) -> list[str]:
        """The human-readable report."""
        c, n = self.concurrency, self.max_model_len
        out = [
            f"model            {self.model} ({self.dtype}, KV {self.kv_cache_dtype}, {self.kv_cache} KV)",
            f"memory           {format_bytes(self.memory_bytes)} on {self.device}: {self.memory_source}",
            f"weights          {format_bytes(self.weight_bytes)} ({self.weight_bytes} bytes)",
            f"KV per token     {self.kv_bytes_per_token} bytes",
            f"KV budget        {format_bytes(self.kv_budget_bytes)}",
        ]
        if self.kv_cache == "paged":
            out += [
                f"KV for {c} x {n}  worst case {format_bytes(self.worst_case_bytes)}, "
                f"expected {format_bytes(self.expected_bytes)} (mean {self.mean_seq_len} tokens)",
            ]
        else:
            out += [f"KV for {c} x {n}  reserved {format_bytes(self.worst_case_bytes)}"]
        pool = f"{self.num_blocks} blocks, {format_bytes(self.kv_pool_bytes)} allocated"
        out.append(
            f"KV pool          {pool}" if not self.error else f"KV pool          {self.error}"
        )
        verdict = "yes" if self.fits else "no"
        if self.kv_cache == "paged" and not self.fits:
            verdict += " (expected load fits)" if self.fits_expected else " (expected load too)"
        out += [
            f"fits             {verdict}",
            f"largest concurrency at {n} tokens: {self.max_concurrency}",
            f"largest context at concurrency {c}: {self.max_context}",
        ]
        return out


def format_bytes(num_bytes: int) -> str:
    """``15.0 GiB``, ``1.0 MiB``: the largest binary unit that keeps a number >= 1."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{num_bytes} B"
        value /= 1024
    return f"{value:.1f} TiB"


def _resolve_model(model: str) -> Path:
    return resolve_model_path(model)


def resolve_model_dtype(dtype: str, cfg: ModelConfig, device: str = "cuda") -> str:
    """``auto`` as ``serve`` resolves it: the checkpoint's torch_dtype on a GPU, the CPU rule
    (``model/cpu_dtype.py``) on a CPU, where the AVX2 kernels are taken to run wherever the
    CPU has AVX2 (they build on first use)."""
    if dtype != "auto":
        return dtype
    declared = str(cfg.torch_dtype).removeprefix("torch.")
    declared = declared if declared in sizing.DTYPE_BYTES else "float32"
    if device == "cpu":
        flags = cpu_flags()
        return cpu_auto_dtype(declared, flags, "avx2" in flags)[0]
    return declared


def build_plan(inputs: PlanInputs) -> CapacityPlan:
    """Size the model, its KV and the pool with the engine's own code."""
    cfg = ModelConfig.from_folder(_resolve_model(inputs.model))
    if inputs.memory_bytes is None:
        machine = this_machine(inputs.device)
    else:
        device = "cuda" if inputs.device == "auto" else inputs.device
        machine = Machine(device, inputs.memory_bytes, "--memory")
    memory_bytes = machine.memory_bytes
    dtype = resolve_model_dtype(inputs.dtype, cfg, machine.device)
    kv_dtype = dtype if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype
    layout = head_layout = "torch"
    if inputs.quantization is not None:  # stored as this machine's CPU kernels read them
        from tokenmill.model.quant import kernel_layout

        layout = kernel_layout(inputs.quantization, inputs.quantization_group_size)
        head_layout = kernel_layout("int8", inputs.quantization_group_size)  # the int8 head
    weights = sizing.weight_bytes(
        cfg,
        dtype,
        inputs.max_model_len,
        inputs.quantization,
        inputs.quantization_group_size,
        layout,  # type: ignore[arg-type]
        head_layout,  # type: ignore[arg-type]
    )
    per_token = sizing.kv_bytes_per_token(
        cfg, sizing.kv_cache_dtype_bytes(inputs.kv_cache_dtype, dtype)
    )
    free = max(0, memory_bytes - weights)
    if machine.device == "cpu":  # what the engine computes once the weights are loaded
        budget = sizing.cpu_kv_budget(inputs.kv_cache_memory, free)
    else:
        budget = sizing.kv_budget_from_memory(
            inputs.kv_cache_memory, memory_bytes, free, inputs.gpu_memory_utilization
        )
    c, n, bs = inputs.concurrency, inputs.max_model_len, inputs.block_size
    mean = inputs.mean_seq_len or max(1, n // 2)
    blocks_per_seq = -(-n // bs)
    block_bytes = bs * per_token
    worst = c * blocks_per_seq * block_bytes
    expected = worst if inputs.kv_cache == "static" else c * -(-mean // bs) * block_bytes
    budget_blocks = budget // block_bytes
    num_blocks, error = 0, None
    try:
        manager = build_kv_manager(
            inputs.kv_cache,
            KVSizing(c, n, bs, True, budget, per_token),
        )
        num_blocks = manager.num_blocks
    except ConfigError as exc:
        error = str(exc)
    return CapacityPlan(
        model=inputs.model,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        kv_cache=inputs.kv_cache,
        device=machine.device,
        memory_bytes=memory_bytes,
        memory_source=machine.source,
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        kv_pool_bytes=(num_blocks + 1) * block_bytes if num_blocks else 0,
        worst_case_bytes=worst,
        expected_bytes=expected,
        fits=error is None and worst <= budget,
        fits_expected=error is None and expected <= budget,
        max_concurrency=budget_blocks // blocks_per_seq,
        max_context=min(budget_blocks // c * bs, cfg.max_position_embeddings),
        concurrency=c,
        max_model_len=n,
        mean_seq_len=mean,
        error=error,
    )


def add_plan_parser(sub: Any) -> None:
    """Register ``tokenmill plan`` on the top-level subcommands."""
    plan = sub.add_parser(
        "plan",
        help="estimate weight and KV memory for a load, with the engine's own sizing",
        description="Will this model serve C requests of N tokens on this much memory? Sizes weights "
        "and KV with the engine's own code, reading only config.json; exits 1 when the worst "
        "case does not fit.",
    )
    plan.add_argument("--model", default="demo", help="Hugging Face model folder, or 'demo'")
    plan.add_argument("--max-model-len", type=int, required=True, help="context length N")
    plan.add_argument("--concurrency", type=int, required=True, help="requests C served at once")
    plan.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype; auto: what serve picks on this device (docs: the CPU dtype rule)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache dtype; auto follows --dtype",
    )
    plan.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weight quantization of the decoder projections (default: none)",
    )
    plan.add_argument(
        "--quantization-group-size",
        type=int,
        default=sizing.INT4_GROUP_SIZE,
        help="int4: input channels per scale and zero point",
    )
    plan.add_argument("--kv-cache", default="paged", choices=sorted(STRATEGIES), help="KV strategy")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    plan.add_argument(
        "--memory",
        type=parse_memory,
        default=None,
        help="device memory, e.g. 80GiB or 24GiB (default: this machine's: a GPU's total where "
        "nvidia-smi finds one, else the available memory within any cgroup limit)",
    )
    plan.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="the device planned for (auto: a GPU where one is found, else the CPU); "
        "with --memory and auto, a GPU",
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of --memory the engine may use (weights + KV)",
    )
    plan.add_argument(
        "--kv-cache-memory",
        type=parse_memory,
        default=None,
        help="an explicit KV budget, e.g. 20GiB, as the engine flag (default: what is left)",
    )
    plan.add_argument(
        "--mean-seq-len",
        type=int,
        default=None,
        help="expected tokens per request for paged KV (default: half of --max-model-len)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; exit status 0 if the worst case fits, 1 if not."""
    for name in ("max_model_len", "concurrency", "block_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.memory is not None and args.memory < 2**20:
        raise ConfigError("--memory must be a size, e.g. 80GiB")
    result = build_plan(
        PlanInputs(
            model=args.model,
            max_model_len=args.max_model_len,
            concurrency=args.concurrency,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            kv_cache=args.kv_cache,
            block_size=args.block_size,
            memory_bytes=None if args.memory is None else int(args.memory),
            device=args.device,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory,
            mean_seq_len=args.mean_seq_len,
        )
    )
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print("\n".join(result.lines()))
    return 0 if result.fits else 1
