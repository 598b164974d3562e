"""Run a batch of requests on an ``LLMEngine`` to completion, outputs in input order.

The offline ``LLM`` API and the offline benchmarks (``tokenmill.bench``) share this loop, so
it lives below both: ``bench`` measures exactly what ``LLM.generate`` runs without importing
``entrypoints``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput

Prompt = str | list[int]


def generate(
    engine: LLMEngine,
    ids: Sequence[str],
    prompts: Sequence[Prompt],
    params: Sequence[SamplingParams],
    priority: Sequence[int] | None = None,
    loras: Sequence[LoRARequest | None] | None = None,
    on_finished: Callable[[], object] | None = None,
    cache_salts: Sequence[str | None] | None = None,
) -> list[RequestOutput]:
    """Submit every request (a refused one aborts those already queued), then run them all.

    Only finished outputs are read, so each request runs with ``FINAL_ONLY``: that spares a
    per-step copy of every request's history.
    """
    final_only = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
    try:
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            engine.add_request(
                rid,
                prompt,
                final_only[id(p)],
                priority=priority[i] if priority else 0,
                lora_request=loras[i] if loras else None,
                cache_salt=cache_salts[i] if cache_salts else None,
            )
    except Exception:
        engine.abort_request(list(ids))  # nothing half-submitted keeps running
        engine.step()
        raise
    return run_to_completion(engine, ids, on_finished)


def run_to_completion(
    engine: LLMEngine, ids: Sequence[str], on_finished: Callable[[], object] | None = None
) -> list[RequestOutput]:
    """Step until the engine is idle; the first of ``ids`` that failed raises (the rest are
    aborted), and ``on_finished`` is called once per finished request (a progress bar)."""
    results: dict[str, RequestOutput] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if on_finished is not None:
                        on_finished()
            failures = engine.take_failures()
            failed = [i for i in ids if i in failures]
            if failed:  # the engine serves on; this call reports the first failure
                raise failures[failed[0]]
    except BaseException:
        engine.abort_request([i for i in ids if i not in results])
        raise
    return [results[i] for i in ids]
