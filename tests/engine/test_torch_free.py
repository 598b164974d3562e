"""The scheduler, block manager and request state must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_core_bookkeeping_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import tokenmill.engine.scheduler, tokenmill.engine.block_manager, tokenmill.engine.request\n"
        "import tokenmill.engine.kv_manager\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
