"""The whole of ``tokenmill.core`` imports with torch made unimportable."""

from __future__ import annotations

import subprocess
import sys


def test_every_core_module_imports_without_torch() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
        "import tokenmill.core\n"
        "names = [m.name for m in pkgutil.walk_packages(tokenmill.core.__path__, 'tokenmill.core.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "assert {'tokenmill.core.scheduler', 'tokenmill.core.kv.paged', 'tokenmill.core.kv.static'} <= set(names)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
