"""The compute-thread policy, tested by its decisions on fixture files (cgroup limits,
CPU topology, environments), never by timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.model.thread_policy import (
    apply_wait_policy,
    cgroup_cpu_quota,
    choose_threads,
    physical_cores,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "50000\n"}, 0.5),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_quota_v2_and_v1(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    for name, text in files.items():
        _write(tmp_path / name, text)
    assert cgroup_cpu_quota(tmp_path) == quota


def test_hyper_thread_siblings_count_once(tmp_path: Path) -> None:
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]:  # 2 cores, 2 threads each
        _write(tmp_path / f"cpu{cpu}/topology/physical_package_id", "0\n")
        _write(tmp_path / f"cpu{cpu}/topology/core_id", f"{core}\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1  # an affinity set of one core's siblings


def test_a_quota_below_the_cores_caps_the_threads() -> None:
    decision = choose_threads(None, range(8), 2.5, num_physical=8, num_online=8)
    assert decision.num_threads == 2
    assert "cgroup CPU quota 2.5 CPUs caps it at 2" in decision.describe()
    tiny = choose_threads(None, range(8), 0.5, num_physical=8)
    assert tiny.num_threads == 1  # never zero
    roomy = choose_threads(None, range(4), 16.0, num_physical=4)
    assert roomy.num_threads == 4


def test_affinity_decides_which_cores_count() -> None:
    decision = choose_threads(None, [2, 3], None, num_physical=2, num_online=16)
    assert decision.num_threads == 2
    assert "affinity 2-3: 2 of 16 CPUs" in decision.reasons
    assert "no cgroup CPU quota" in decision.reasons


def test_the_flag_wins() -> None:
    assert choose_threads(3, range(8), 1.0, num_physical=8).num_threads == 3


def test_wait_policy_is_set_unless_the_user_chose_one() -> None:
    env: dict[str, str] = {}
    assert "spin briefly" in apply_wait_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}  # sleep at once: no spin count added
    assert "from the environment" in apply_wait_policy(passive)
    assert passive == {"OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert "from the environment" in apply_wait_policy(mine)
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE"}
    spin = {"GOMP_SPINCOUNT": "1000"}
    apply_wait_policy(spin)
    assert "OMP_WAIT_POLICY" not in spin
    late: dict[str, str] = {}
    assert "imported before tokenmill" in apply_wait_policy(late, is_runtime_loaded=True)


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_tokenmill_sets_the_policy_before_torch_loads(
    given: str | None, seen: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = (
        "import os, sys, tokenmill; "
        "print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    spin = "1000" if given is None else "None"
    assert out == [seen, spin, "False"]  # set, and torch not loaded yet
