"""One-stream speculative decoding TPOT in one process: plain vs ngram vs draft.

The server benchmark (``spec_decode.py``) starts a server per configuration, so on a loaded
machine its rows are minutes apart. This one builds the three engines (demo model, greedy,
k=4, ``--kv-cache`` paged or static) in one process and alternates them request by request,
so load drift hits all alike; TPOT is per request ``(last token time - first token time) /
(tokens - 1)`` from the engine's own step loop (no HTTP), and the report is medians and
ratios to plain. Greedy outputs must equal plain's token for token (checked).

    PYTHONPATH=src .venv/bin/python benchmarks/spec_inproc.py --kv paged --rounds 3
    PYTHONPATH=src .venv/bin/python benchmarks/spec_inproc.py --profile ngram   # cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_workload import copy_share
from spec_decode import WORKLOADS

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.model.demo import demo_draft_path
from tokenmill.model.layers import GEMV_ENV


def build(config: str, args: argparse.Namespace) -> LLMEngine:
    return build_llm(config, args).engine


def build_llm(config: str, args: argparse.Namespace) -> LLM:
    """``config`` is plain, ngram or draft (or a draft_* variant below); ``@onednn`` after it
    loads the projections in oneDNN's layout instead of tokenmill's GEMV blocks (an A/B of
    the GEMV kernels in one process)."""
    config, _, layout = config.partition("@")
    if layout == "onednn":
        os.environ[GEMV_ENV] = "0"
        try:
            return build_llm(config, args)
        finally:
            del os.environ[GEMV_ENV]
    spec: dict[str, Any] | None = None
    if config == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    elif config.startswith("draft"):
        spec = {"model": str(demo_draft_path()), "num_speculative_tokens": args.k}
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache=args.kv,
        num_threads=args.threads,
        speculative_config=spec,
    )
    drafter = llm.engine.executor.driver_worker.drafter  # type: ignore[attr-defined]
    if config == "draft_runner":  # variants for A/B: every draft forward through its runner
        drafter.rows = None
    elif config == "draft_eager":  # the decode-row loop, never compiled
        drafter.rows.compiled = None
        drafter.loops = {}
    elif config == "draft_noloop":  # compiled rows, one call per draft forward
        drafter.loops = {}
    elif config == "draft_loop" and not drafter.loops:  # paged: compile the draft loops anyway
        worker = llm.engine.executor.driver_worker  # type: ignore[attr-defined]
        for rows in (1, 2):
            model, caches = drafter.runner.model, drafter.rows.kv_caches
            loop = worker._compile_draft_loop(model, caches, rows, args.k)
            if loop is not None:
                drafter.loops[rows, args.k] = loop
    return llm


def one_request(
    engine: LLMEngine, rid: str, prompt: str, max_tokens: int
) -> tuple[float, list[int]]:
    """(TPOT seconds, output tokens) of one request run alone through the step loop."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == rid and out.outputs[0].token_ids:
                first = first or now
                last = now
                tokens = list(out.outputs[0].token_ids)
    assert first is not None and last is not None and len(tokens) > 1
    return (last - first) / (len(tokens) - 1), tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    engines = {c: build(c, args) for c in args.configs}
    report: dict[str, Any] = {"kv": args.kv, "workloads": {}}
    for workload in args.workloads:
        prompts = WORKLOADS[workload](args.num_requests)
        configs = [
            c for c in args.configs if not c.startswith("ngram") or workload.startswith("copy")
        ]
        for c in configs:  # warm-up
            one_request(engines[c], f"warm-{c}", prompts[0], 8)
        tpots: dict[str, list[float]] = {c: [] for c in configs}
        outputs: dict[str, dict[int, list[int]]] = {c: {} for c in configs}
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                order = configs if (i + r) % 2 == 0 else configs[::-1]
                for c in order:
                    tpot, tokens = one_request(engines[c], f"{c}-{r}-{i}", prompt, args.max_tokens)
                    tpots[c].append(tpot)
                    outputs[c][i] = tokens
        mism = [c for c in configs if outputs[c] != outputs[configs[0]]]
        med = {c: statistics.median(v) * 1e3 for c, v in tpots.items()}
        row: dict[str, Any] = {"tpot_ms_median": med, "identical": not mism}
        tokenizer = engines[configs[0]].tokenizer
        row["copy_share"] = statistics.fmean(
            copy_share(tokenizer.encode(p), outputs[configs[0]][i]) for i, p in enumerate(prompts)
        )
        if "plain" in med:
            row["ratio_to_plain"] = {c: med[c] / med["plain"] for c in med}
        for c in configs:
            s = engines[c].stats
            if s.spec_num_drafts:
                row.setdefault("mean_accepted_length", {})[c] = (
                    1 + s.spec_num_accepted_tokens / s.spec_num_drafts
                )
        for c in configs:
            drafter = engines[c].executor.driver_worker.drafter  # type: ignore[attr-defined]
            if drafter is not None and drafter.loops:
                row.setdefault("draft_loop_calls", {})[c] = {
                    str(key): loop.num_calls for key, loop in drafter.loops.items()
                }
        report["workloads"][workload] = row
        print(json.dumps({workload: row}), flush=True)
    return report


def profile(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    config = args.profile
    engine = build(config, args)
    prompts = WORKLOADS[args.workloads[0]](args.num_requests)
    one_request(engine, "warm", prompts[0], 8)
    prof = cProfile.Profile()
    steps_before = engine.stats.num_steps
    prof.enable()
    for i, prompt in enumerate(prompts):
        one_request(engine, f"p{i}", prompt, args.max_tokens)
    prof.disable()
    steps = engine.stats.num_steps - steps_before
    print(f"{config}: {steps} steps")
    stats = pstats.Stats(prof).sort_stats(args.sort)
    stats.print_stats(args.top)


class _StepLog:
    """Per step of one engine: its kind, wall time, tokens produced, draft-model time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.kinds: dict[str, list[float]] = {}
        self.tokens: dict[str, int] = {}
        self.parts: dict[str, dict[str, list[float]]] = {}
        self._part_s: dict[str, float] = {}
        self._proposed = False
        worker = engine.executor.driver_worker  # type: ignore[attr-defined]
        runner = worker.runner
        targets = [
            ("forward", runner, "forward"),
            ("prepare", runner, "prepare_inputs"),
            ("verify", runner, "_verify"),
            ("sample", runner, "_sample"),
            ("on_verified", engine, "_on_verified"),
            ("propose", engine, "_propose"),
            ("schedule", engine.scheduler, "schedule"),
            ("outputs", engine.output_processor, "collect"),
        ]
        if worker.drafter is not None:
            targets.append(("draft", worker.drafter, "propose"))
        for name, obj, attr in targets:
            self._wrap(name, obj, attr)
        if engine.speculative is not None:
            propose = engine._propose

            def marked() -> None:
                propose()
                self._proposed = any(r.spec_token_ids for r in engine.scheduler.running)

            engine._propose = marked  # type: ignore[method-assign]

    def _wrap(self, name: str, obj: Any, attr: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self._part_s[name] = self._part_s.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def request(self, rid: str, prompt: str, max_tokens: int) -> None:
        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, params)
        before = 0
        while engine.has_unfinished_requests():
            request = next(iter(engine.scheduler.requests.values()))
            is_prefill = request.num_computed_tokens < request.num_tokens - 1
            self._part_s, self._proposed = {}, False
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            n = len(outs[0].outputs[0].token_ids) if outs else before
            kind = "prefill" if is_prefill else ("verify" if self._proposed else "decode")
            self.kinds.setdefault(kind, []).append(dt)
            for name, value in self._part_s.items():
                self.parts.setdefault(kind, {}).setdefault(name, []).append(value)
            self.tokens[kind] = self.tokens.get(kind, 0) + n - before
            before = n

    def summary(self) -> dict[str, Any]:
        return {
            k: {
                "steps": len(v),
                "tokens": self.tokens[k],
                "median_ms": round(statistics.median(v) * 1e3, 3),
                "mean_ms": round(statistics.fmean(v) * 1e3, 3),
                "parts_ms_mean": {
                    name: round(sum(values) / len(v) * 1e3, 3)
                    for name, values in self.parts.get(k, {}).items()
                },
            }
            for k, v in self.kinds.items()
        }


def breakdown(args: argparse.Namespace) -> None:
    """Per step, interleaved across the configs: wall time of engine.step by kind
    (prefill, decode without drafts, verify), tokens produced, draft-model time."""
    torch.set_num_threads(args.threads)
    logs = {c: _StepLog(build(c, args)) for c in args.configs}
    prompts = WORKLOADS[args.workloads[0]](args.num_requests)
    for c, log in logs.items():
        one_request(log.engine, f"warm-{c}", prompts[0], 8)
    for i, prompt in enumerate(prompts):
        for c in logs if i % 2 == 0 else list(logs)[::-1]:
            logs[c].request(f"b{c}{i}", prompt, args.max_tokens)
    for c, log in logs.items():
        print(json.dumps({c: log.summary()}), flush=True)


def batch(args: argparse.Namespace) -> None:
    """All prompts at once (16 streams): output tok/s per config, repeats interleaved."""
    torch.set_num_threads(args.threads)
    llms = {c: build_llm(c, args) for c in args.configs}
    prompts = WORKLOADS[args.workloads[0]](args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {c: [] for c in llms}
    for r in range(args.rounds + 1):
        for c in llms if r % 2 == 0 else list(llms)[::-1]:
            start = time.perf_counter()
            outs = llms[c].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if r:  # the first round warms up
                rates[c].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    med = {c: statistics.median(v) for c, v in rates.items()}
    print(
        json.dumps({"tok_s_median": med, "ratio_to_plain": {c: med[c] / med["plain"] for c in med}})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv", default="paged", choices=["paged", "static"])
    parser.add_argument("--configs", nargs="+", default=["plain", "ngram", "draft"])
    parser.add_argument("--workloads", nargs="+", default=["copy", "text"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="cProfile one config instead")
    parser.add_argument("--breakdown", action="store_true", help="per-step times by kind")
    parser.add_argument("--batch", action="store_true", help="all prompts at once: tok/s")
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.profile:
        profile(args)
        return
    if args.breakdown:
        breakdown(args)
        return
    if args.batch:
        batch(args)
        return
    report = run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
