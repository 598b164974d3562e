"""tokenmill: an LLM inference engine and OpenAI-compatible server.

The top-level names load lazily, so that importing a torch-free module such as
``tokenmill.core.scheduler`` does not pull in torch. Importing the package sets the OpenMP
wait policy first (``model/thread_policy.py``), while torch's runtime has not read it yet.
"""

from __future__ import annotations

import sys
from typing import Any

from tokenmill.model import thread_policy as _thread_policy

# Before anything imports torch: its OpenMP runtime reads the wait policy once, as it loads.
_thread_policy.WAIT_POLICY_NOTE = _thread_policy.apply_wait_policy(
    is_runtime_loaded="torch" in sys.modules
)

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "EngineConfig": "tokenmill.config",
    "LoRARequest": "tokenmill.lora_request",
    "CompletionOutput": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.core.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
