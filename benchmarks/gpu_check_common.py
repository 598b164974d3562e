"""The helpers of ``gpu_check.py``: its report, the tiny models, greedy references and the
engine facts each stage records (split out so each file stays one concept)."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (before torch, in every stage: the OpenMP wait policy)

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "parity", "throughput", "serve")
MAX_NEW = 10
START = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - START:6.1f}s] {msg}", flush=True)


class Report:
    """One stage's results, rewritten to disk after each check so a killed stage keeps them."""

    def __init__(self, path: Path, stage: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"stage": stage, "checks": {}, "errors": {}}
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - START, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def check(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one sub-check; its return value (or its error) is recorded under ``name``."""
        log(f"{self.data['stage']}: {name} ...")
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            self.data["checks"][name] = {"ok": False, "traceback": traceback.format_exc()[-4000:]}
            log(f"{self.data['stage']}: {name} FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            value = None
        else:
            if isinstance(value, dict):
                value.setdefault("ok", True)
            self.data["checks"][name] = value
            log(f"{self.data['stage']}: {name}: {_short(value)}")
        if isinstance(self.data["checks"][name], dict):
            self.data["checks"][name]["seconds"] = round(time.monotonic() - start, 2)
        self.save()
        _free_memory()
        return value


def _short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def watch_cpu_kernel_loads(report: Report) -> None:
    """Record every call that would load tokenmill's CPU kernels (building them if no cached
    build exists), with the stack that asked; the original ``load`` still answers."""
    from tokenmill.kernels import ops

    original = ops.load
    calls: list[str] = report.data.setdefault("cpu_kernel_load_calls", [])

    def load() -> bool:
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        calls.append(stack[-2500:])
        report.save()
        return original()

    ops.load = load


def conftest() -> Any:
    """tests/conftest.py's model helpers (loaded by path: a site-packages ``tests`` package
    cannot shadow it); it limits torch to 2 threads on import, which is undone here."""
    import torch

    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("tokenmill_conftest", REPO / "tests/conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(threads)
    return module


# ---------------------------------------------------------------------------------- models


def tokenizer_dir(work: Path) -> Path:
    folder = work / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        from tokenmill.model.demo import build_bpe_tokenizer

        build_bpe_tokenizer(folder)
    return folder


def tiny_model(work: Path, family: str) -> Path:
    """A tiny random model as tests/conftest.py's ``make_model`` builds it (peaked logits)."""
    folder = work / f"tiny-{family}"
    if (folder / "config.json").is_file():
        return folder
    import shutil

    import torch
    import transformers

    from tokenmill.tokenizer import Tokenizer

    helpers = conftest()
    tok = tokenizer_dir(work)
    config = helpers._hf_config(family, Tokenizer.from_pretrained(tok).vocab_size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    helpers._reinit(model, 0)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.float32).save_pretrained(tmp)
    for f in tok.iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(folder)
    return folder


def random_prompts(vocab: int, num: int, seed: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def greedy(max_tokens: int = MAX_NEW) -> Any:
    from tokenmill.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(folder: Path, device: str, dtype: str, kv: str, buckets: tuple[int, ...], **kw: Any):
    from tokenmill.entrypoints.llm import LLM

    options: dict[str, Any] = dict(max_model_len=256, max_num_seqs=8, kv_cache_memory=2**30)
    if kv == "static":
        options["compile_batch_sizes"] = buckets
    options.update(kw)
    return LLM(str(folder), device=device, dtype=dtype, kv_cache=kv, **options)


def close(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.engine.shutdown()


def engine_facts(llm: Any) -> dict[str, Any]:
    """What ran: step counts of the compiled (CUDA-graph) decode, compile time, fallbacks."""
    facts: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        runner = llm.engine.runner
        facts["num_compiled_steps"] = runner.num_compiled_steps
        step = runner.compiled_decode
        if step is not None:
            facts["compiled_buckets"] = step.buckets
            facts["eager_buckets"] = step.eager_buckets
            facts["cuda_graphs"] = step.use_cuda_graphs
            facts["compile_s_by_bucket"] = {
                k: round(v, 2) for k, v in step.compile_s_by_bucket.items()
            }
        facts["step_runners"] = [r.name for r in runner.step_runners]
    with contextlib.suppress(Exception):
        facts["compile_time_s"] = round(llm.engine.stats.compile_time_s, 2)
    with contextlib.suppress(Exception):
        facts["device"] = str(next(llm.engine.runner.model.parameters()).device)
    return facts


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """Exact match, and per prompt the length of the common prefix (bf16 drifts on ties)."""
    prefixes = []
    for g, w in zip(got, want, strict=True):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        prefixes.append(n)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=False))
    total = sum(len(w) for w in want)
    return {
        "exact": got == want,
        "common_prefix_lens": prefixes,
        "token_agreement": round(same / max(total, 1), 3),
    }
