"""Multi-LoRA benchmark: what serving adapters costs against the base model, in one process.

Workload: 16 concurrent streams of 128 -> 64 tokens (EOS ignored) on the ~250M
benchmark Llama of ``engine_core.py``, three ways, interleaved round by round on one engine:
  base   every request on the base model
  one    every request on one adapter
  mixed  8 adapters, 2 requests each, in the same batches
Adapters are rank 16 on all seven projections (q, k, v, o, gate, up, down), random weights,
written in PEFT's layout. Each round draws fresh prompts, so no run reuses another's KV.
Target: ``mixed`` at >= 80% of ``base``'s output tok/s.

    .venv/bin/python benchmarks/lora.py --out results/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed_batch, warm_up
from engine_core import build_model

from tokenmill.entrypoints.llm import LLM
from tokenmill.lora_request import LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(folder: Path, shape: dict[str, Any], rank: int, seed: int) -> Path:
    """A PEFT LoRA folder with random A and B for every projection of every layer."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    h, i = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = head_dim * shape["num_attention_heads"], head_dim * shape["num_key_value_heads"]
    dims = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for name, (fan_in, fan_out) in dims.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(fan_out, rank, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache/tokenmill"))
    parser.add_argument("--model-dir", type=Path, default=cache / "bench-llama-250m")
    parser.add_argument("--adapter-dir", type=Path, default=cache / "bench-lora-250m")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per scenario")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = str(build_model(args.model_dir))
    shape = json.loads((Path(model) / "config.json").read_text())
    adapters = [
        LoRARequest(
            f"bench{k}",
            k + 1,
            str(build_adapter(args.adapter_dir / f"r{args.rank}-{k}", shape, args.rank, k)),
        )
        for k in range(args.num_adapters)
    ]
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=args.streams,
        num_threads=args.threads,
        enable_lora=True,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
    )
    n = args.streams
    scenarios: dict[str, list[LoRARequest | None]] = {
        "base": [None] * n,
        "one": [adapters[0]] * n,
        "mixed": [adapters[i % len(adapters)] for i in range(n)],
    }
    warm_up(llm, n, lora_request=scenarios["mixed"])  # every adapter loaded into its slot
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in scenarios}
    for rnd in range(args.rounds):
        for k, (name, loras) in enumerate(scenarios.items()):
            result, _ = timed_batch(
                llm, len(loras), args.input_len, args.output_len, rnd * 10 + k, lora_request=loras
            )
            runs[name].append(result)
            print(f"round {rnd} {name:6s} {result['output_tok_s']:7.1f} output tok/s", flush=True)
    summary = {
        name: statistics.mean(r["output_tok_s"] for r in results) for name, results in runs.items()
    }
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "threads": args.threads,
        "torch": torch.__version__,
        "workload": {
            "streams": n,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "adapters": args.num_adapters,
            "rank": args.rank,
            "targets": TARGETS,
        },
        "runs": runs,
        "output_tok_s": summary,
        "vs_base": {name: value / summary["base"] for name, value in summary.items()},
        "lora_slot_bytes": llm.engine.runner.lora.stacks.nbytes if llm.engine.runner.lora else 0,
    }
    for name, value in summary.items():
        print(f"{name:6s} {value:7.1f} output tok/s  ({report['vs_base'][name]:.0%} of base)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
