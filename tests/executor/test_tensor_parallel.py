"""Tensor parallelism over two gloo ranks: the same greedy tokens as one rank, in fp32.

Each family's fixture runs with prefix caching and a KV cache tight enough to preempt, on
both KV strategies for Llama; a model with one KV head checks the replicated-KV path and
the MoE families the experts split inside each expert. A rank killed mid-service is named in
the engine's error, which never hangs.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ConfigError
from tokenmill.executor import WorkerDiedError
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.model.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = list(range(10, 34))  # shared: prefix-cache hits
    return [system + [rng.randrange(4, 500) for _ in range(rng.randint(8, 40))] for _ in range(num)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _run(folder, tp: int, **kwargs) -> tuple[list[list[int]], dict[str, int]]:
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=8,
        max_num_seqs=4,
        tensor_parallel_size=tp,
        num_threads=1,
        **kwargs,
    )
    try:
        if tp > 1:
            assert isinstance(llm.engine.executor, MultiprocExecutor)
            assert llm.engine.executor.world_size == tp
        out = _tokens(llm.generate(_prompts(6, seed=11), GREEDY, use_tqdm=False))
        stats = llm.engine.stats
        return out, {"preemptions": stats.num_preemptions, "hits": stats.num_prefix_hit_tokens}
    finally:
        llm.engine.shutdown()


CASES = [
    ("llama", {}, "paged"),
    ("llama", {}, "static"),
    ("llama", {"num_key_value_heads": 1}, "paged"),  # fewer KV heads than ranks: replicated
    ("qwen3", {}, "paged"),  # per-head q/k norm
    ("phi3", {}, "paged"),  # fused qkv and gate_up tensors in the checkpoint
    ("gemma2", {}, "paged"),  # sandwich norms, tied (vocab-parallel) head, soft-capping
    ("mixtral", {}, "paged"),  # experts split inside each expert
    ("qwen2_moe", {}, "paged"),  # plus a shared expert and its gate
    ("mistral", {}, "paged"),  # sliding window
    ("qwen2", {}, "paged"),  # q/k/v bias (column-parallel)
    ("llama_bias", {}, "paged"),  # o and down bias (row-parallel: added once)
    ("gemma3", {}, "paged"),  # per-head q/k norm with Gemma's offset, per-layer RoPE
    ("olmo2", {}, "paged"),  # q/k norm over all heads: sum of squares all-reduced
    ("olmo2", {"num_key_value_heads": 1}, "paged"),  # ... with a replicated KV head
    ("qwen3_moe", {}, "paged"),  # per-head q/k norm, normalised top-k
]
"""One of each way a family differs for the split (each case starts two ranks: seconds)."""


def _kv_kwargs(kv_cache: str, folder, tp: int) -> dict:
    """Paged: KV memory for 12 blocks of 8 tokens on each rank (whatever its share of the
    KV heads), so six prompts of 32-64 tokens must preempt."""
    if kv_cache != "paged":
        return {"kv_cache": kv_cache}
    cfg = ModelConfig.from_folder(folder)
    kv_heads = max(1, cfg.num_kv_heads // tp)
    per_token = 2 * cfg.num_layers * kv_heads * cfg.head_dim * 4
    return {"kv_cache": kv_cache, "kv_cache_memory": 12 * 8 * per_token}


@pytest.mark.parametrize(("family", "overrides", "kv_cache"), CASES)
def test_tp2_greedy_tokens_equal_tp1(make_model, family, overrides, kv_cache) -> None:
    folder = make_model(family, **overrides)
    one, one_stats = _run(folder, 1, **_kv_kwargs(kv_cache, folder, 1))
    two, two_stats = _run(folder, 2, **_kv_kwargs(kv_cache, folder, 2))
    assert two == one
    if kv_cache == "paged":
        assert two_stats["preemptions"] > 0 and two_stats["hits"] > 0
        assert two_stats == one_stats


def test_tp_refuses_what_does_not_split(make_model) -> None:
    folder = make_model("llama")
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide"):
        LLM(str(folder), dtype="float32", max_model_len=64, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="does not support LoRA adapters"):
        LLM(str(folder), tensor_parallel_size=2, enable_lora=True)
    draft = {"model": str(folder), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="does not support a draft model"):
        LLM(str(folder), tensor_parallel_size=2, speculative_config=draft)


def test_a_killed_rank_is_named(make_model) -> None:
    llm = LLM(
        str(make_model("llama")),
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=2,
        num_threads=1,
    )
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    try:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(executor.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="rank 1 died"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.engine.shutdown()
