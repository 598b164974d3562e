"""The tensor-parallel process group: joined once per rank process, before the model loads.

gloo on CPU, NCCL on CUDA, through the same ``torch.distributed`` calls, so the model's
parallel layers (``model/tensor_parallel.py``) are written once.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig

PROCESS_GROUP_TIMEOUT_S = 120
"""A collective that waits longer than this fails (a peer that died mid-step)."""


def init_distributed(config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
    """Join the group (nothing to do for one rank)."""
    if world_size == 1:
        return
    use_cuda = config.device.startswith("cuda") or (
        config.device == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
