"""The KV pool's resident bytes: measured (mincore), so they rise as blocks are first used
and never exceed the pool, which is what tells a filling pool from a leak."""

from __future__ import annotations

import mmap

import torch

from tokenmill.worker.kv_cache import resident_bytes, zeroed


def test_untouched_pages_are_not_resident_and_touched_ones_are() -> None:
    page = mmap.PAGESIZE
    pool = zeroed((64, page), torch.uint8, torch.device("cpu"))  # 64 pages, lazily mapped
    assert resident_bytes([pool]) == 0
    pool[3, 0] = 1
    pool[10, 5] = 1
    pool[10, 7] = 1  # the same page again
    assert resident_bytes([pool]) == 2 * page
    pool.fill_(1)
    assert resident_bytes([pool]) == 64 * page


def test_the_engine_reports_what_its_pool_holds_in_memory() -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine import batch
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model="demo", dtype="float32", kv_cache_memory=64 * 2**20, max_num_seqs=4)
    )
    engine.executor.driver_worker.resident_every_s = 0  # measured on each read, not once a second
    pool_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    before = engine.stats.kv_cache_resident_bytes
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch.generate(engine, ["a", "b"], [[5] * 300, [6] * 300], [params, params])
    after = engine.stats.kv_cache_resident_bytes
    assert before < after <= pool_bytes
    assert after < pool_bytes  # two 308-token requests touch a sliver of a 64 MiB pool
