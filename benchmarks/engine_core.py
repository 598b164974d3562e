"""Engine-core benchmark: tokenmill against transformers ``generate``, side by side in one run.

Workloads, on a ~250M-parameter Llama with random fp32 weights:
  fixed   32 requests, 128 prompt -> 64 output tokens (EOS ignored), all at once
  mixed   32 requests, prompts U[16, 256], outputs U[16, 128]
  single  1 request, 128 -> 64
  batch8  8 requests, 128 -> 64 (TPOT at batch 8, for the static-vs-paged comparison)
  mixed-long  32 requests, prompts U[16, 1024], outputs U[16, 256] (the static-KV comparison;
          run with max_model_len 1280 so every request fits a static slot)
Baseline: transformers ``generate`` on left-padded static batches of ``--batch-size`` (16).
Also measured in the same process: torch's fp32 GEMM GFLOP/s (the compute ceiling), the
memory read bandwidth (the decode bound at batch 1), and KV-cache waste after prefill.

    .venv/bin/python benchmarks/engine_core.py --out results/engine_core.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import save_random_model

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.offline import OfflineConfig, format_offline_table, run_offline_benchmark

MODEL_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=2048,
)


DEFAULT_MODEL_DIR = (
    Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache/tokenmill")) / "bench-llama-250m"
)
"""Where the benchmark scripts build (once) and find the benchmark model."""


def build_model(folder: Path) -> Path:
    """The benchmark model: transformers' Llama with random weights (seeded), saved once."""
    import transformers

    return save_random_model(
        folder,
        lambda: transformers.LlamaConfig(
            **MODEL_SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1
        ),
    )


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def gemm_gflops() -> dict[str, float]:
    """fp32 GEMM rate at the model's largest projection (1024 -> 2 x 2816), per batch size."""
    weight = torch.randn(2 * MODEL_SHAPE["intermediate_size"], MODEL_SHAPE["hidden_size"])
    out = {}
    for m in (1, 16, 32, 512, 2048):
        x = torch.randn(m, MODEL_SHAPE["hidden_size"])
        secs = _time(
            lambda x=x: torch.nn.functional.linear(x, weight), repeats=max(3, 2048 // m // 8)
        )
        out[f"m{m}"] = 2 * m * weight.numel() / secs / 1e9
    out["ceiling"] = max(out.values())
    return out


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth: summing a 1 GiB fp32 tensor (bigger than any cache)."""
    x = torch.ones(2**28)
    secs = _time(lambda: x.sum(), repeats=5)
    return x.numel() * 4 / secs / 1e9


def model_flops(cfg: dict[str, int], forward_tokens: int, logit_rows: int) -> float:
    """2 FLOPs per weight per token; the LM head only for rows whose logits are used."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return 2.0 * (cfg["num_hidden_layers"] * per_layer * forward_tokens + v * h * logit_rows)


WORKLOAD_MAX_MODEL_LEN = {"mixed-long": 1280}
"""max_model_len per workload (512 otherwise): static reserves max_num_seqs x this."""


def workload(name: str, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    vocab = MODEL_SHAPE["vocab_size"]

    def req(prompt_len: int, output_len: int) -> BenchRequest:
        return BenchRequest(
            prompt_token_ids=[rng.randrange(4, vocab) for _ in range(prompt_len)],
            prompt_len=prompt_len,
            output_len=output_len,
        )

    if name == "fixed":
        return [req(128, 64) for _ in range(32)]
    if name == "mixed":
        return [req(rng.randint(16, 256), rng.randint(16, 128)) for _ in range(32)]
    if name == "single":
        return [req(128, 64)]
    if name == "batch8":
        return [req(128, 64) for _ in range(8)]
    if name == "mixed-long":
        return [req(rng.randint(16, 1024), rng.randint(16, 256)) for _ in range(32)]
    raise ValueError(name)


def kv_waste_after_prefill(
    model: str, requests: list[BenchRequest], engine_kwargs: dict[str, Any]
) -> dict[str, dict]:
    """Reserved-but-unused KV token slots over reserved, when the last prompt is prefilled."""
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.entrypoints.llm import LLM

    out = {}
    for kind in ("paged", "static"):
        llm = LLM(
            model, dtype="float32", **{**engine_kwargs, "kv_cache": kind, "enforce_eager": True}
        )
        engine = llm.engine
        for i, r in enumerate(requests):
            engine.add_request(
                str(i), r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            )
        while engine.scheduler.waiting or any(
            q.num_computed_tokens < q.num_prompt_tokens for q in engine.scheduler.running
        ):
            engine.step()
        reserved = engine.kv_manager.num_reserved_token_slots
        used = sum(q.num_computed_tokens for q in engine.scheduler.running)
        out[kind] = {
            "reserved_tokens": reserved,
            "used_tokens": used,
            "waste": (reserved - used) / reserved,
        }
        engine.abort_request([str(i) for i in range(len(requests))])
        del llm, engine
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
    )
    parser.add_argument("--workloads", default="fixed,mixed,single")
    parser.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-caches", default="paged,static", help="tokenmill KV strategies to compare"
    )
    parser.add_argument(
        "--backends",
        default="tokenmill,transformers",
        help="bench offline backends; transformers (static batches) is the baseline, "
        "transformers-cb adds its continuous batching",
    )
    parser.add_argument(
        "--compile-batch-sizes", default="1,8,32", help="static: decode buckets to compile"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the full result JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = str(build_model(args.model_dir))
    engine_kwargs: dict[str, Any] = {
        "max_model_len": 512,
        "max_num_seqs": 32,
        "num_threads": args.threads,
        "compile_batch_sizes": tuple(int(b) for b in args.compile_batch_sizes.split(",")),
    }
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads,
        "torch": torch.__version__,
        "model_shape": MODEL_SHAPE,
        "workloads": {},
    }
    result["gemm_gflops"] = gemm_gflops()
    result["read_bandwidth_gbs"] = read_bandwidth_gbs()
    ceiling = result["gemm_gflops"]["ceiling"]
    print(
        f"GEMM fp32: {json.dumps({k: round(v, 1) for k, v in result['gemm_gflops'].items()})} GFLOP/s; "
        f"read bandwidth {result['read_bandwidth_gbs']:.1f} GB/s",
        flush=True,
    )

    for name in args.workloads.split(","):
        requests = workload(name)
        config = OfflineConfig(
            model=model,
            backends=tuple(args.backends.split(",")),
            kv_caches=tuple(args.kv_caches.split(",")),
            dtype="float32",
            device="cpu",
            batch_size=args.batch_size,
            compare=True,
            num_rounds=args.rounds,
            num_warmups=1,
            engine_kwargs={**engine_kwargs, "max_model_len": WORKLOAD_MAX_MODEL_LEN.get(name, 512)},
        )
        res = run_offline_benchmark(config, requests, workload={"name": name})
        rows = {row["label"]: row for row in res["backends"] if not row.get("skipped")}
        hf = next(
            row for label, row in rows.items() if label.startswith("transformers[")
        )  # static batches
        forward_tokens = sum(r.prompt_len + r.output_len - 1 for r in requests)
        flops = model_flops(MODEL_SHAPE, forward_tokens, sum(r.output_len for r in requests))
        summary: dict[str, Any] = {
            "transformers_output_tok_s": hf["output_throughput"],
            "transformers_tpot_ms_median": hf["median_tpot_ms"],
        }
        if "transformers-cb" in rows:
            summary["transformers_cb_output_tok_s"] = rows["transformers-cb"]["output_throughput"]
            summary["transformers_cb_tpot_ms_median"] = rows["transformers-cb"]["median_tpot_ms"]
        for label, row in rows.items():
            if not label.startswith("tokenmill"):
                continue
            seconds = sum(r.output_len for r in requests) / row["output_throughput"]
            summary[label] = {
                "output_tok_s": row["output_throughput"],
                "ratio_vs_transformers": row["output_throughput"] / hf["output_throughput"],
                "tpot_ms_median": row["median_tpot_ms"],
                "gflops": flops / seconds / 1e9,
                "fraction_of_gemm_ceiling": flops / seconds / 1e9 / ceiling,
                "load_s": row.get("load_s"),
                "compile_time_s": row.get("compile_time_s"),
                "kv_pool_tokens": row.get("kv_pool_tokens"),
                "kv_reserved_tokens_mean": row.get("kv_reserved_tokens_mean"),
                "kv_used_tokens_mean": row.get("kv_used_tokens_mean"),
                "kv_waste_step_mean": row.get("kv_waste"),
            }
        if name == "single":
            weight_bytes = model_flops(MODEL_SHAPE, 1, 1) / 2 * 4
            summary["decode_bound_ms"] = weight_bytes / (result["read_bandwidth_gbs"] * 1e9) * 1e3
        result["workloads"][name] = {"summary": summary, "offline": res}
        print(
            f"\n== {name} ==\n{format_offline_table(res)}\n{json.dumps(summary, indent=2)}",
            flush=True,
        )

    result["kv_waste_after_prefill"] = {
        f"block_size={bs}": kv_waste_after_prefill(
            model, workload("mixed"), {**engine_kwargs, "block_size": bs}
        )
        for bs in (16, 8)
    }
    print(f"KV waste after prefill (mixed): {result['kv_waste_after_prefill']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
