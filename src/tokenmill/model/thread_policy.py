"""How many compute threads to run, and how they wait: chosen from what this process may
really use, and said at start-up.

A machine's core count is not what a process gets: a container's CPU affinity (``taskset``,
``--cpuset-cpus``) and a cgroup's CPU quota (``docker --cpus``, Kubernetes limits) both cap
it, and a thread per core beyond them only queues. Each parallel region ends when its last
thread finishes, so a thread that lost its core holds up the whole step: one stream of a
270M model went from 32 to 600 ms a token beside a job using one of two cores. So:

- threads: one per physical core of the affinity set, at most the cgroup quota (rounded
  down, at least 1), or ``--num-threads``. A hyper-thread sibling adds no GEMM throughput
  and makes every region wait for the slower sibling (on 2 cores, 250M model: 246 tok/s at
  16 streams with 2 threads against 142 with 1);
- waiting: OpenMP threads that finish their share spin briefly, then sleep
  (``GOMP_SPINCOUNT=1000`` with ``OMP_WAIT_POLICY=passive``: libgomp spins ~1,000 pauses,
  some microseconds; Intel's runtime, which ignores the count, sleeps at once). A decode step
  is ~300 parallel regions back to back, and waking a sleeping thread for each cost a third
  of SmolLM2's one-stream step on a 2-vCPU Zen 5 (13.2-13.6 -> 9.3 ms in process) and nearly
  half on a 2-vCPU AMX Xeon (bf16 16.6 -> 10.8-11.0 ms, int4 9.2 -> 4.1; 300 spins left it at
  12.7-14.0 and 6.2-6.6 there). Spinning longer hurts when another job holds a core: beside
  ``stress-ng --cpu 1`` the one-stream step took 14.6 ms sleeping at once, 16.9-17.6 at 300,
  21.9 at 1,000 and 85.4 at 10,000 on the Zen 5; on the Xeon int4 7.1, 8.3 and 10.9 at 0,
  300 and 1,000 (``docs/benchmarks.md``). Set before torch loads its OpenMP runtime
  (``tokenmill/__init__.py``); a user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins
  (``OMP_WAIT_POLICY=PASSIVE`` alone: sleep at once, for a host shared with other jobs);
- the ops claim their work in chunks (``parallel_chunks`` in the C++ kernels), so a thread
  that loses its core leaves its share to the others.

Everything here reads files and takes their paths as arguments, so the decisions are tested
on fixtures, not on the machine the tests run on. No torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_WAIT_POLICY = "PASSIVE"
DEFAULT_SPIN_COUNT = "1000"


@dataclass(frozen=True)
class ThreadDecision:
    """The compute threads chosen, and why (for the start-up log)."""

    num_threads: int
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.num_threads} compute threads ({'; '.join(self.reasons)})"


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup allows (``cpu.max`` in v2, cfs quota/period in v1);
    None when unlimited or unreadable."""
    try:
        fields = (root / "cpu.max").read_text().split()
    except OSError:
        fields = []
    if fields:
        if fields[0] == "max":
            return None
        try:
            return int(fields[0]) / (int(fields[1]) if len(fields) > 1 else 100000)
        except (ValueError, ZeroDivisionError):
            return None
    try:
        v1_quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        v1_period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return v1_quota / v1_period if v1_quota > 0 and v1_period > 0 else None


def physical_cores(
    cpus: Iterable[int], topology_root: Path = Path("/sys/devices/system/cpu")
) -> int:
    """Distinct (package, core) pairs among ``cpus``: hyper-thread siblings count once."""
    cores = set()
    for cpu in cpus:
        topo = topology_root / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (
                    (topo / "physical_package_id").read_text().strip(),
                    (topo / "core_id").read_text().strip(),
                )
            )
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))


def choose_threads(
    requested: int | None,
    affinity: Iterable[int],
    quota_cpus: float | None,
    num_physical: int,
    num_online: int | None = None,
) -> ThreadDecision:
    """The thread count from the flag, else the affinity set's physical cores capped by the
    cgroup quota; ``num_online`` (the machine's CPUs) only makes the reason say what was cut."""
    cpus = sorted(affinity)
    if requested:
        return ThreadDecision(requested, ("--num-threads",))
    reasons = []
    shown = _cpu_ranges(cpus)
    if num_online is not None and len(cpus) < num_online:
        reasons.append(f"affinity {shown}: {len(cpus)} of {num_online} CPUs")
    else:
        reasons.append(f"affinity {shown}")
    reasons.append(f"{num_physical} physical cores")
    count = num_physical
    if quota_cpus is not None:
        allowed = max(1, math.floor(quota_cpus))
        if allowed < count:
            reasons.append(f"cgroup CPU quota {quota_cpus:g} CPUs caps it at {allowed}")
            count = allowed
        else:
            reasons.append(f"cgroup CPU quota {quota_cpus:g} CPUs")
    else:
        reasons.append("no cgroup CPU quota")
    reasons.append("--num-threads overrides")
    return ThreadDecision(count, tuple(reasons))


def default_thread_decision(requested: int | None = None) -> ThreadDecision:
    """``choose_threads`` for this process, as the worker starts."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    return choose_threads(requested, cpus, cgroup_cpu_quota(), physical_cores(cpus), os.cpu_count())


def apply_wait_policy(
    environ: MutableMapping[str, str] = os.environ, is_runtime_loaded: bool = False
) -> str:
    """Make idle OpenMP threads spin briefly, then sleep, unless the user chose a policy;
    says which.

    Must run before the OpenMP runtime loads (it reads the variable once), so
    ``tokenmill/__init__.py`` calls it before anything imports torch; ``is_runtime_loaded``
    (torch was imported first) makes it say the setting came too late.
    """
    given = [f"{name}={environ[name]}" for name in WAIT_POLICY_VARIABLES if name in environ]
    if given:
        return f"OpenMP wait policy from the environment ({', '.join(given)})"
    environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    environ["GOMP_SPINCOUNT"] = DEFAULT_SPIN_COUNT
    if is_runtime_loaded:
        return (
            "OpenMP wait policy: the runtime's own (torch was imported before tokenmill; "
            f"set OMP_WAIT_POLICY={DEFAULT_WAIT_POLICY} GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT} "
            "before starting Python for threads that spin briefly, then yield)"
        )
    return (
        f"OpenMP threads spin briefly, then sleep (GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT}, "
        f"OMP_WAIT_POLICY={DEFAULT_WAIT_POLICY}; OMP_WAIT_POLICY=PASSIVE alone to sleep at "
        "once on a host shared with other jobs)"
    )


WAIT_POLICY_NOTE = ""
"""What ``apply_wait_policy`` did in this process (set at import of ``tokenmill``)."""


def _cpu_ranges(cpus: list[int]) -> str:
    """``0-3,8`` for [0, 1, 2, 3, 8]."""
    parts: list[str] = []
    for cpu in cpus:
        if parts and cpu == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts) or "none"
