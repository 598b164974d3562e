"""One short GPU check of tokenmill: parity with transformers, a throughput figure, a served chat.

Meant for one leased GPU machine (scripts/gpu_check.sh runs each stage in its own process,
under its own time limit, so one crash or hang leaves the others' results); runs on the CPU
too (``--device cpu --quick``) as a dry run of the same code with smaller sizes.

Stages (``--stage``), each writing ``<out>/<stage>.json`` after every sub-check:
  env         torch, CUDA and device versions
  parity      tiny random Llama (and Qwen3, Gemma 3): tokenmill's offline ``LLM`` greedy tokens
              against transformers' ``generate`` on the same device, float32 (exact) for the
              paged and static strategies; bfloat16 agreement; n>1 sampling, a batch of mixed
              lengths with chunked prefill, a prefix-cache hit
  throughput  ~250M random Llama (benchmarks/engine_core.py's shape) in bfloat16: one request
              128 -> 128 (TPOT) and 64 requests 128 -> 128 (output tok/s), through
              tokenmill[paged], transformers ``generate`` (one static batch of 64) and
              tokenmill[static] (compiled, CUDA graphs on GPU), with the offline backends of
              ``tokenmill bench offline``
  serve       ``tokenmill serve`` on loopback and one chat completion over raw HTTP
  summary     every stage's JSON merged into ``<out>/result.json``, and a short printout

tokenmill's C++ CPU kernels are never needed on CUDA; every call that would load (and, with
no cached build, compile) them is recorded in the stage's ``cpu_kernel_load_calls`` with its
stack, so a CUDA run shows whether anything asks.

    PYTHONPATH=src .venv/bin/python benchmarks/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (before torch, in every stage: the OpenMP wait policy)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_common import (
    MAX_NEW,
    REPO,
    STAGES,
    START,
    Report,
    agreement,
    close,
    engine_facts,
    greedy,
    make_llm,
    random_prompts,
    tiny_model,
    watch_cpu_kernel_loads,
)

# ---------------------------------------------------------------------------------- stages


def stage_env(args: argparse.Namespace, report: Report) -> None:
    def versions() -> dict[str, Any]:
        import numpy
        import tokenizers
        import torch
        import transformers

        info: dict[str, Any] = {
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": numpy.__version__,
            "cpu_count": os.cpu_count(),
        }
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(
                device_name=props.name,
                capability=f"{props.major}.{props.minor}",
                sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1),
                bf16_supported=torch.cuda.is_bf16_supported(),
                cudnn=torch.backends.cudnn.version(),
            )
        with contextlib.suppress(Exception):
            import triton

            info["triton"] = triton.__version__
        return info

    report.check("versions", versions)

    def imports() -> dict[str, Any]:
        """tokenmill's optional and required imports, and where each comes from."""
        import importlib

        found = {}
        for name in (
            "msgspec",
            "llguidance",
            "fastapi",
            "uvicorn",
            "pydantic",
            "starlette",
            "httpx",
            "gguf",
            "openai",
            "typing_extensions",
            "anyio",
            "tokenmill",
        ):
            try:
                module = importlib.import_module(name)
                found[name] = f"{getattr(module, '__version__', '?')} {module.__file__}"
            except Exception as exc:
                found[name] = f"MISSING {type(exc).__name__}: {exc}"
        import tokenmill.entrypoints.llm  # noqa: F401  (the offline path's imports)

        return found

    report.check("imports", imports)


def stage_parity(args: argparse.Namespace, report: Report) -> None:
    import torch

    from tokenmill.entrypoints.check import transformers_greedy

    device = args.device
    work = args.work
    watch_cpu_kernel_loads(report)
    prompts_cache: dict[str, list[list[int]]] = {}

    def prompts_for(folder: Path) -> list[list[int]]:
        key = str(folder)
        if key not in prompts_cache:
            from tokenmill.tokenizer import Tokenizer

            vocab = Tokenizer.from_pretrained(folder).vocab_size
            prompts_cache[key] = random_prompts(vocab, 4, seed=1)
        return prompts_cache[key]

    ref_cache: dict[tuple, list[list[int]]] = {}

    def reference(folder: Path, prompts: list[list[int]], dtype: Any) -> list[list[int]]:
        key = (str(folder), str(dtype), tuple(map(tuple, prompts)))
        if key not in ref_cache:
            ref_cache[key] = transformers_greedy(folder, prompts, MAX_NEW, dtype, device)
        return ref_cache[key]

    def parity(
        family: str, kv: str, dtype_name: str, buckets: tuple[int, ...] = (1, 4)
    ) -> dict[str, Any]:
        """Four prompts as one batch, then two alone; static compiles ``buckets`` (a batch of
        one runs in bucket 1, or padded to 4 where only (4,) is compiled)."""
        folder = tiny_model(work, family)
        dtype = getattr(torch, dtype_name)
        prompts = prompts_for(folder)
        want = reference(folder, prompts, dtype)
        llm = make_llm(folder, device, dtype_name, kv, buckets)
        try:
            batch = [
                o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)
            ]
            single = [
                llm.generate([p], greedy(), use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts[:2]
            ]
            result = {
                "batch": agreement(batch, want),
                "one_at_a_time": agreement(single, want[:2]),
                **engine_facts(llm),
            }
            result["ok"] = result["batch"]["exact"] and result["one_at_a_time"]["exact"]
            if not result["ok"]:
                result["got"], result["want"] = batch, want
            return result
        finally:
            close(llm)
            del llm

    report.check("llama_fp32_paged", lambda: parity("llama", "paged", "float32"))
    report.check("llama_fp32_static", lambda: parity("llama", "static", "float32"))

    def extras() -> dict[str, Any]:
        """On one paged fp32 engine: n>1 sampling, a batch of 16 mixed lengths through
        7-token prefill chunks (exact against transformers), a prefix-cache hit."""
        from tokenmill.core.sampling_params import SamplingParams
        from tokenmill.tokenizer import Tokenizer

        folder = tiny_model(work, "llama")
        vocab = Tokenizer.from_pretrained(folder).vocab_size
        out: dict[str, Any] = {}
        llm = make_llm(folder, device, "float32", "paged", (), max_num_batched_tokens=7)
        try:
            sampling = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=7, max_tokens=12)
            prompts = random_prompts(vocab, 2, seed=5)
            first = llm.generate(prompts, sampling, use_tqdm=False)
            again = llm.generate(prompts, sampling, use_tqdm=False)
            seqs = [[c.token_ids for c in o.outputs] for o in first]
            out["n4_sampling"] = {
                "completions_per_prompt": [len(s) for s in seqs],
                "lengths": [[len(t) for t in s] for s in seqs],
                "distinct_per_prompt": [len({tuple(t) for t in s}) for s in seqs],
                "ids_in_vocab": all(0 <= t < vocab for s in seqs for c in s for t in c),
                "seeded_repeat_equal": seqs == [[c.token_ids for c in o.outputs] for o in again],
            }
            out["n4_sampling"]["ok"] = (
                all(n == 4 for n in out["n4_sampling"]["completions_per_prompt"])
                and out["n4_sampling"]["ids_in_vocab"]
            )
            mixed = random_prompts(vocab, 16, seed=2, max_len=100)
            want = transformers_greedy(folder, mixed, MAX_NEW, torch.float32, device)
            got = [o.outputs[0].token_ids for o in llm.generate(mixed, greedy(), use_tqdm=False)]
            out["mixed16_chunked7"] = agreement(got, want)
            shared = random.Random(9).sample(range(4, vocab), 80)  # 5 blocks of 16
            before = llm.engine.stats.num_prefix_hit_tokens
            a = llm.generate([shared], greedy(), use_tqdm=False)[0]
            b = llm.generate([shared], greedy(), use_tqdm=False)[0]
            out["prefix_cache"] = {
                "prompt_len": len(shared),
                "first_cached_tokens": a.num_cached_tokens,
                "second_cached_tokens": b.num_cached_tokens,
                "hit_tokens_counted": llm.engine.stats.num_prefix_hit_tokens - before,
                "same_output": a.outputs[0].token_ids == b.outputs[0].token_ids,
            }
            out["prefix_cache"]["ok"] = (
                b.num_cached_tokens > 0 and out["prefix_cache"]["same_output"]
            )
            out["ok"] = (
                out["n4_sampling"]["ok"]
                and out["mixed16_chunked7"]["exact"]
                and out["prefix_cache"]["ok"]
            )
            return out
        finally:
            close(llm)
            del llm

    report.check("llama_fp32_paged_extras", extras)
    bf16_ok = device == "cpu" or torch.cuda.is_bf16_supported()
    if bf16_ok:
        for kv in ("paged", "static"):
            report.check(
                f"llama_bf16_{kv}_agreement",
                lambda kv=kv: parity("llama", kv, "bfloat16", (4,)) | {"ok": True},
            )
    for family in ("qwen3", "gemma3"):
        if time.monotonic() - START > args.budget_s:
            report.data["skipped"] = report.data.get("skipped", []) + [f"{family}: over budget"]
            report.save()
            continue
        report.check(f"{family}_fp32_paged", lambda f=family: parity(f, "paged", "float32"))
    if time.monotonic() - START <= args.budget_s:
        report.check("qwen3_fp32_static", lambda: parity("qwen3", "static", "float32", (4,)))


def stage_throughput(args: argparse.Namespace, report: Report) -> None:
    import torch

    from tokenmill.bench.datasets import BenchRequest
    from tokenmill.bench.metrics import summarize_rounds
    from tokenmill.bench.offline import MemoryMeter, OfflineConfig
    from tokenmill.bench.offline_backends import make_backend

    watch_cpu_kernel_loads(report)
    device = args.device
    if args.quick:
        shape = dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=2048,
            max_position_embeddings=512,
        )
        folder_name, in_len, out_len, batch = "bench-llama-quick", 32, 16, 4
    else:
        import engine_core

        shape = dict(engine_core.MODEL_SHAPE)
        folder_name, in_len, out_len, batch = "bench-llama-250m", 128, 128, 64

    def build() -> dict[str, Any]:
        import transformers
        from _common import save_random_model

        folder = save_random_model(
            args.work / folder_name,
            lambda: transformers.LlamaConfig(
                **shape, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1
            ),
        )
        report.data["model"] = str(folder)
        return {"folder": str(folder), "shape": shape}

    if report.check("build_model", build) is None:
        return
    folder = report.data["model"]
    rng = random.Random(0)
    vocab = shape["vocab_size"]

    def requests(num: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
        return [
            BenchRequest(
                prompt_len=prompt_len,
                output_len=output_len,
                prompt_token_ids=[rng.randrange(4, vocab) for _ in range(prompt_len)],
            )
            for _ in range(num)
        ]

    single, many = requests(1, in_len, out_len), requests(batch, in_len, out_len)
    warmup = requests(batch, 16, 8) + requests(1, in_len, 4)
    kv_bytes = 8 * 2**30 if device != "cpu" else 2**30
    rows = [("tokenmill", "paged"), ("transformers", None), ("tokenmill", "static")]
    meter = MemoryMeter(device)

    def measure(name: str, kv: str | None) -> dict[str, Any]:
        engine_kwargs: dict[str, Any] = dict(
            max_model_len=512, max_num_seqs=batch, kv_cache_memory=kv_bytes
        )
        if kv == "static":
            engine_kwargs["compile_batch_sizes"] = (1, batch)
        config = OfflineConfig(
            model=folder,
            backends=(name,),
            kv_caches=(kv or "paged",),
            dtype=args.bench_dtype,
            device=device,
            batch_size=batch,
            engine_kwargs=engine_kwargs if name == "tokenmill" else {},
        )
        start = time.monotonic()
        with meter.peak_growth() as load_box:
            backend = make_backend(name, config, kv)
        result: dict[str, Any] = {
            "load_s": round(time.monotonic() - start, 2),
            "load_memory_mib": round(load_box["growth_bytes"] / 2**20),
        }
        try:
            with contextlib.suppress(Exception):
                figures = backend.load_figures()
                result["compile_time_s"] = figures.get("compile_time_s")
                result["compile_cache"] = figures.get("compile_cache")
            if name == "tokenmill":
                result.update(engine_facts(backend))
            backend.run(warmup)
            for label, reqs in (("batch1", single), (f"batch{batch}", many)):
                with meter.peak_growth() as box:
                    records, duration_s = backend.run(reqs)
                summary = summarize_rounds([(records, duration_s)])
                result[label] = {
                    "requests": len(reqs),
                    "in_out": [in_len, out_len],
                    "completed": summary.get("completed"),
                    "duration_s": round(duration_s, 3),
                    "output_tok_s": round(summary["output_throughput"], 1),
                    "median_ttft_ms": _round(summary.get("median_ttft_ms")),
                    "median_tpot_ms": _round(summary.get("median_tpot_ms")),
                    "p95_tpot_ms": _round(summary.get("p95_tpot_ms")),
                    "run_peak_growth_mib": round(box["growth_bytes"] / 2**20),
                }
            if name == "tokenmill":
                result["num_compiled_steps"] = engine_facts(backend).get("num_compiled_steps")
            result["ok"] = all(
                result[k]["completed"] == len(r)
                for k, r in (("batch1", single), (f"batch{batch}", many))
            )
            return result
        finally:
            backend.close()
            del backend

    for name, kv in rows:
        label = f"{name}[{kv}]" if kv else name
        report.check(label, lambda name=name, kv=kv: measure(name, kv))
    table = {}
    for label, value in report.data["checks"].items():
        if isinstance(value, dict) and "batch1" in value:
            table[label] = {
                "tpot_ms_batch1": value["batch1"]["median_tpot_ms"],
                f"out_tok_s_batch{batch}": value[f"batch{batch}"]["output_tok_s"],
            }
    report.data["table"] = table
    report.data["device_name"] = torch.cuda.get_device_name(0) if device != "cpu" else "cpu"
    report.save()


def _round(value: Any, digits: int = 2) -> Any:
    return round(value, digits) if isinstance(value, (int, float)) else value


def stage_serve(args: argparse.Namespace, report: Report) -> None:
    import httpx
    from _common import Server, tokenmill_command

    folder = tiny_model(args.work, "llama")
    port = args.port
    base = f"http://127.0.0.1:{port}"
    server_log = args.out / "serve.log"
    command = tokenmill_command(
        "serve",
        "--model",
        str(folder),
        "--device",
        args.device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
    )
    report.data["command"] = command

    def chat() -> dict[str, Any]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (env.get("PYTHONPATH", ""), str(REPO / "src")) if p
        )
        start = time.monotonic()
        with Server(
            command, base, log=server_log, env=env, ready_timeout_s=args.serve_wait_s
        ) as srv:
            ready_s = time.monotonic() - start
            models = httpx.get(base + "/v1/models", timeout=10).json()
            model_id = models["data"][0]["id"]
            body = {
                "model": model_id,
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 16,
                "temperature": 0,
            }
            t0 = time.monotonic()
            resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            latency = time.monotonic() - t0
            payload = resp.json()
            metrics = httpx.get(base + "/metrics", timeout=10).text
            lines = [
                line
                for line in metrics.splitlines()
                if not line.startswith("#") and ("gpu" in line or "kv_cache" in line)
            ][:12]
            result = {
                "ready_s": round(ready_s, 1),
                "status": resp.status_code,
                "latency_s": round(latency, 3),
                "model": model_id,
                "reply": payload,
                "metrics_sample": lines,
                "server_log_tail": srv.log_tail(8),
            }
            result["ok"] = resp.status_code == 200 and bool(
                payload.get("choices", [{}])[0].get("message", {}).get("content") is not None
            )
            return result

    report.check("chat_completion", chat)


def summary(args: argparse.Namespace) -> int:
    merged: dict[str, Any] = {"device": args.device, "quick": args.quick, "stages": {}}
    for stage in STAGES:
        path = args.out / f"{stage}.json"
        if path.is_file():
            try:
                merged["stages"][stage] = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                merged["stages"][stage] = {"unreadable": str(exc)}
        else:
            merged["stages"][stage] = {"missing": "the stage wrote nothing (crashed before start?)"}
    status_path = args.out / "stage_status.txt"
    if status_path.is_file():
        merged["exit_codes"] = status_path.read_text().split()
    (args.out / "result.json").write_text(json.dumps(merged, indent=1, default=str))
    print("==== gpu_check summary ====")
    for stage, data in merged["stages"].items():
        checks = data.get("checks", {})
        oks = {k: (v.get("ok") if isinstance(v, dict) else None) for k, v in checks.items()}
        print(f"{stage}: {json.dumps(oks)}")
        for name, err in data.get("errors", {}).items():
            print(f"  ERROR {name}: {err[:300]}")
        if data.get("cpu_kernel_load_calls"):
            print(f"  cpu kernel load calls: {len(data['cpu_kernel_load_calls'])}")
            print("  first caller:\n" + data["cpu_kernel_load_calls"][0][-700:])
        if "missing" in data or "skipped" in data:
            print(f"  {data.get('missing') or data.get('skipped')}")
    env = merged["stages"].get("env", {}).get("checks", {}).get("versions")
    if isinstance(env, dict):
        print("env:", json.dumps({k: env.get(k) for k in ("torch", "device_name", "transformers")}))
    parity = merged["stages"].get("parity", {}).get("checks", {})
    for name, value in parity.items():
        if isinstance(value, dict) and "batch" in value:
            print(
                f"  {name}: exact={value['batch'].get('exact')} agree={value['batch'].get('token_agreement')}"
                f" compiled_steps={value.get('num_compiled_steps')} graphs={value.get('cuda_graphs')}"
            )
    table = merged["stages"].get("throughput", {}).get("table")
    if table:
        print("throughput:", json.dumps(table))
    chat = merged["stages"].get("serve", {}).get("checks", {}).get("chat_completion")
    if isinstance(chat, dict) and "status" in chat:
        reply = chat.get("reply", {})
        content = (reply.get("choices") or [{}])[0].get("message", {}).get("content")
        print(f"serve: status={chat['status']} ready_s={chat.get('ready_s')} content={content!r}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=(*STAGES, "all", "summary"), default="all")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (cpu: a dry run)")
    parser.add_argument("--quick", action="store_true", help="small throughput model and workload")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_check")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_check_work"))
    parser.add_argument("--bench-dtype", default="bfloat16")
    parser.add_argument(
        "--budget-s", type=float, default=100.0, help="parity: optional families stop here"
    )
    parser.add_argument("--port", type=int, default=18517)
    parser.add_argument("--serve-wait-s", type=float, default=90.0)
    args = parser.parse_args()
    # The shell's time limit sends SIGTERM: unwind, so a started server is stopped and the
    # report keeps what it has.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "summary":
        return summary(args)
    stages = STAGES if args.stage == "all" else (args.stage,)
    for stage in stages:
        report = Report(args.out / f"{stage}.json", stage)
        report.data["device"] = args.device
        try:
            globals()[f"stage_{stage}"](args, report)
        except Exception as exc:  # a stage's set-up failed: recorded, the next stage runs
            report.data["errors"]["stage"] = f"{type(exc).__name__}: {exc}"
            report.data["traceback"] = traceback.format_exc()[-4000:]
            traceback.print_exc()
        report.data["done"] = True
        report.save()
    if args.stage == "all":
        return summary(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
