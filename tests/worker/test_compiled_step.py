"""The static strategy's compiled decode: engines in one process compile independently.

Dynamo caches graphs and counts recompiles per code object; with one shared code object a
few compiled engines in a process used to exhaust ``recompile_limit`` (8) and fail with
``FailOnRecompileLimitHit``. Each engine below compiles three buckets, so the old code failed
at the third model. Compiling 3 x 3 buckets of tiny models takes about a minute on 2 CPU cores
with an empty inductor cache, about 15 s with a warm one.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.worker.compiled_step import CompiledDecodeStep

FAMILIES = ["llama", "qwen2", "qwen3"]
BUCKETS = (1, 2, 4)
PROMPTS = [[5, 9, 13, 200, 7], [42, 43], [300, 301, 302, 303, 304, 305, 306], [11]]
# Different lengths, so decode batches shrink 4 -> 2 -> 1 and every bucket runs.
MAX_TOKENS = [3, 9, 5, 9]


def _greedy_ids(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _static(folder, compile_batch_sizes: tuple[int, ...] = BUCKETS) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        kv_cache="static",
        compile_batch_sizes=compile_batch_sizes,
    )


def _paged_greedy_ids(folder) -> list[list[int]]:
    return _greedy_ids(LLM(str(folder), dtype="float32", max_model_len=64, max_num_seqs=4))


def test_compiled_engines_of_several_families_coexist(make_model) -> None:
    """Compiled engines of three families in one process: each compiles every bucket and matches paged."""
    expected = {}
    engines = {}
    for family in FAMILIES:
        folder = make_model(family)
        expected[family] = _paged_greedy_ids(folder)
        llm = _static(folder)
        step = llm.engine.runner.compiled_decode
        assert step is not None, family
        assert (step.buckets, step.eager_buckets) == (list(BUCKETS), []), family
        assert _greedy_ids(llm) == expected[family], family
        assert llm.engine.runner.num_compiled_steps > 0, family
        engines[family] = llm
    # The first engine's graphs still serve it after the others compiled theirs.
    first = engines[FAMILIES[0]]
    steps_before = first.engine.runner.num_compiled_steps
    assert _greedy_ids(first) == expected[FAMILIES[0]]
    assert first.engine.runner.num_compiled_steps > steps_before
    assert first.engine.runner.compiled_decode.eager_buckets == []


def _failing_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    raise RuntimeError("no compiler on this machine")


def test_a_bucket_that_cannot_compile_runs_eagerly_with_a_warning(
    make_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_model("llama")
    expected = _paged_greedy_ids(folder)

    def compile_with_a_broken_backend(self: CompiledDecodeStep):
        return torch.compile(self._forward, dynamic=False, fullgraph=True, backend=_failing_backend)

    monkeypatch.setattr(CompiledDecodeStep, "_compile_forward", compile_with_a_broken_backend)
    with caplog.at_level(logging.WARNING, logger="tokenmill.worker.compiled_step"):
        llm = _static(folder)
    step = llm.engine.runner.compiled_decode
    assert step.buckets == [] and step.eager_buckets == list(BUCKETS)
    assert sum(
        "could not compile the decode forward" in r.getMessage() for r in caplog.records
    ) == len(BUCKETS)
    assert _greedy_ids(llm) == expected
    assert llm.engine.runner.num_compiled_steps == 0


def test_a_compiled_forward_that_fails_at_run_time_falls_back(
    make_model, caplog: pytest.LogCaptureFixture
) -> None:
    """If dynamo fails later (e.g. a recompile over the limit), that step and its bucket run eagerly."""
    folder = make_model("llama")
    expected = _paged_greedy_ids(folder)
    llm = _static(folder, compile_batch_sizes=(4,))
    step = llm.engine.runner.compiled_decode

    def over_the_limit(*args: torch.Tensor) -> torch.Tensor:
        raise torch._dynamo.exc.FailOnRecompileLimitHit(
            "recompile_limit reached with fullgraph=True"
        )

    step._fns[4] = over_the_limit
    with caplog.at_level(logging.WARNING, logger="tokenmill.worker.compiled_step"):
        assert _greedy_ids(llm) == expected
    assert step.buckets == [] and step.eager_buckets == [4]
    assert any("could not recompile" in r.getMessage() for r in caplog.records)


def test_start_up_costs_per_bucket_and_a_warm_second_start(
    make_model, caplog: pytest.LogCaptureFixture
) -> None:
    """Each bucket's compile time is recorded; a second start of the same shapes is served
    by inductor's cache and says ``warm`` (the first is ``cold`` unless the cache had them)."""
    folder = make_model("llama")
    first = _static(folder, compile_batch_sizes=(2,)).engine.startup
    assert set(first.compile_s_by_bucket) == {2}
    assert set(first.compile_cache_by_bucket.values()) <= {"warm", "cold"}
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        second = _static(folder, compile_batch_sizes=(2,)).engine.startup
    assert second.compile_cache_by_bucket == {2: "warm"}
    assert second.compile_cache == "warm" and second.compile_s > 0
    assert second.total_s >= second.model_load_s + second.kv_allocation_s + second.compile_s
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiled decode bucket 2 in ") and "cache warm" in m for m in messages)
    assert any(m.startswith("start-up costs: model load") for m in messages)


def test_bf16_gemv_layout_compiles_and_matches_eager(make_model, caplog) -> None:
    """A one-stream bf16 engine keeps its projections in tokenmill's GEMV layout
    (``Linear.pack_for_gemv``); the compiled decode traces the op through its fake and
    gives the eager engine's greedy tokens."""
    from tokenmill import kernels

    if not kernels.available() or not kernels.active_isa().startswith("avx512_bf16"):
        pytest.skip("the GEMV layout is used with the AVX-512 BF16 kernels only")
    folder = make_model("llama", dtype="bfloat16")
    kwargs = dict(dtype="bfloat16", max_model_len=64, max_num_seqs=1, kv_cache="static")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        compiled = LLM(str(folder), compile_batch_sizes=(1,), **kwargs)
        got = compiled.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert "eager" not in caplog.text
    model = compiled.engine.runner.model
    assert model.lm_head.gemv is not None and model.layers[0].mlp.down.gemv is not None
    eager = LLM(str(folder), enforce_eager=True, **kwargs)
    want = eager.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
