"""The CPU KV pool is zero and costs resident memory only as its blocks are written."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.conftest import anon_rss_bytes
from tokenmill.model.config import ModelConfig
from tokenmill.worker.kv_cache import allocate_kv_cache

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").is_file(), reason="reads RssAnon from /proc/self/status"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_pool_is_zero_and_resident_only_where_written(make_model, dtype) -> None:
    cfg = ModelConfig.from_folder(make_model("llama"))
    per_block = 16 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    num_blocks = (64 * 2**20) // (2 * cfg.num_layers * per_block)  # a 64 MiB pool
    before = anon_rss_bytes()
    caches = allocate_kv_cache(cfg, num_blocks, 16, dtype, torch.device("cpu"))
    assert len(caches) == cfg.num_layers
    k, v = caches[0]
    assert k.shape == (num_blocks + 1, 16, cfg.num_kv_heads, cfg.head_dim) and k.dtype == dtype
    assert anon_rss_bytes() - before < 8 * 2**20  # nothing committed yet (torch.zeros: 64 MiB)
    assert all(t[::97].float().abs().sum() == 0 for pair in caches for t in pair)
    k[3] = 1.0
    v[num_blocks].fill_(2.0)  # the scratch block
    assert k[3].float().sum() == k[3].numel() and k[2].float().abs().sum() == 0
    for _, v_layer in caches:
        v_layer.fill_(1.0)
    assert anon_rss_bytes() - before > 20 * 2**20  # written blocks are resident
    del caches, k, v, v_layer
    gc.collect()
    assert anon_rss_bytes() - before < 8 * 2**20  # and freed with the tensors
