"""Building and loading tokenmill's C++ CPU kernels, once per machine and torch version.

The sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension`` into
``$TOKENMILL_CACHE/kernels/<key>`` (default ``~/.cache/tokenmill``), where the key hashes the
sources, the compiler flags, torch's version and the Python ABI; later processes load the
cached library directly. Where there is no compiler (or ninja), the CPU is not x86-64, or
the build fails, one warning says so and every op keeps its torch implementation. A failed
build leaves ``<key>.failed`` beside it, so later processes do not spend the same minute
failing again; it is retried once the compiler or ninja changes, or the file is deleted.
``TOKENMILL_CPU_KERNELS=0`` turns the kernels off; ``TOKENMILL_CPU_ISA=avx2`` forces the
AVX2 kernels on an AVX-512 machine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)

ENV_SWITCH = envs.CPU_KERNELS
"""Set to 0 to run every op on torch's kernels."""
ENV_ISA = envs.CPU_ISA
"""auto (default), avx512 or avx2: which kernel table the extension selects at load."""

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "ops.cpp",
    "ops_linear.cpp",
    "ops_norm_rope.cpp",
    "ops_attention.cpp",
    "ops_decode.cpp",
    "ops_sampling.cpp",
    "avx512.cpp",
    "avx2.cpp",
    "amx.cpp",
    "vnni.cpp",
)
"""The translation units: the ops (``ops*.cpp``, ATen), then one per ISA (no ATen header)."""
HEADERS = tuple(sorted(path.name for path in CSRC.glob("*.h")))
"""Every header in ``csrc/``, so the cache key covers one added later too."""
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")
"""-fopenmp: ATen's parallel_for is inlined into the op files and runs on OpenMP there."""
LDFLAGS = ("-fopenmp",)


def cache_root() -> Path:
    return envs.cache_root()


def build_key() -> str:
    """Hash of everything the compiled library depends on."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(sysconfig.get_config_var("SOABI")).encode())
    return digest.hexdigest()[:16]


def is_switched_on() -> bool:
    return not envs.is_off(ENV_SWITCH)


def _compile(name: str, folder: Path) -> Path:
    """Build into ``folder`` and load; returns the library's path."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    _with_venv_bin()
    cpp_extension.load(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    return folder / f"{name}.so"


def _with_venv_bin() -> None:
    """ninja may be installed in this interpreter's environment without being on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


def toolchain() -> str:
    """The compiler and ninja a build would use (path and mtime): a failed build is retried
    when this changes."""
    _with_venv_bin()
    parts = []
    for tool in (os.environ.get("CXX", "c++"), "ninja"):
        found = shutil.which(tool)
        stamp = int(os.stat(found).st_mtime) if found else 0
        parts.append(f"{tool}={found}@{stamp}")
    return " ".join(parts)


@functools.cache
def load() -> bool:
    """Load (building first if needed) the extension; True if its ops are registered."""
    if not is_switched_on():
        logger.info("CPU kernels off (%s=0): torch kernels only", ENV_SWITCH)
        return False
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        logger.warning(
            "tokenmill CPU kernels need Linux on x86-64 (this is %s %s); using torch kernels",
            sys.platform,
            platform.machine(),
        )
        return False
    key = build_key()
    name = f"tokenmill_cpu_{key}"
    folder = cache_root() / "kernels" / key
    library = folder / f"{name}.so"
    failed = folder.with_name(f"{key}.failed")
    cached = library.is_file()
    # Only a build depends on the toolchain (and looking it up puts the venv on PATH).
    tools = "" if cached else toolchain()
    if not cached and failed.is_file():
        recorded = failed.read_text(errors="replace").split("\n", 1)
        if recorded[0] == tools:
            logger.warning(
                "tokenmill CPU kernels unavailable (their build failed before: %s; delete %s "
                "to retry); using torch kernels",
                recorded[1].strip()[:300] if len(recorded) > 1 else "no reason recorded",
                failed,
            )
            return False
    scratch = folder.with_name(f"{key}.build-{os.getpid()}")
    try:
        if cached:
            torch.ops.load_library(str(library))
        else:
            logger.info("building tokenmill CPU kernels into %s (once)", folder)
            # Built (and loaded) aside, then moved in whole: a process starting meanwhile
            # never loads a half-written library.
            built = _compile(name, scratch)
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(built, library)
            failed.unlink(missing_ok=True)
    except Exception as exc:  # no compiler, no ninja, a compile error: torch kernels still run
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {first[:300]}"
        logger.warning("tokenmill CPU kernels unavailable (%s); using torch kernels", reason)
        if not cached and not library.is_file():  # (another process may have built it)
            with contextlib.suppress(OSError):
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(f"{tools}\n{reason}\n")
        return False
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if torch.ops.tokenmill_cpu.isa() == "none":
        logger.warning("tokenmill CPU kernels need AVX2 or AVX-512 BF16; using torch kernels")
        return False
    from tokenmill.kernels.fakes import register_fakes

    register_fakes()
    return True
