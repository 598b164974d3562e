"""MoE benchmark: output tok/s of a random Mixtral (8 experts, top-2) and where a step goes.

Workload: greedy decoding, EOS ignored, 1 and 16 concurrent streams of
``--prompt-len`` -> ``--max-tokens`` tokens, in one process. The share of step time spent in
routing (router matmul, softmax, top-k) and in expert dispatch (sort by expert, one gate/up
and one down matmul per active expert, scatter back) is measured by timing
``SparseMoE.route`` and ``SparseMoE.dispatch`` inside the real engine's steps.

``--shape full`` is a few-hundred-million-parameter MoE model (~360M: hidden 1024,
8 layers, 8 experts of 1408); ``--shape small`` (hidden 512, 4 layers, 8 experts of 704) is
cheap enough for a busy machine. ``--with-transformers`` adds transformers' ``generate`` on
the same weights (1 stream, then 16 padded). vLLM's CPU backend is run separately with
``../shared/peers/vllm-cpu.sh`` on the saved folder (not from here).

    .venv/bin/python benchmarks/moe.py --shape small --out results/moe.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import save_random_model, timed_batch, warm_up

from tokenmill.entrypoints.llm import LLM
from tokenmill.model.moe import SparseMoE

SHAPES: dict[str, dict[str, Any]] = {
    "full": dict(
        hidden_size=1024,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
    ),
    "tiny": dict(  # smoke tests only: every dimension a multiple of 64 for vLLM's CPU kernels
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
    ),
}


def build_model(folder: Path, shape: dict[str, Any]) -> Path:
    """A random Mixtral (seeded) with the project's byte-level BPE tokenizer, saved once."""
    import transformers

    return save_random_model(
        folder,
        lambda: transformers.MixtralConfig(
            **shape, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1
        ),
    )


class StepTimer:
    """Wraps SparseMoE.route/dispatch with wall-clock timers (the engine runs one thread)."""

    def __init__(self) -> None:
        self.seconds = {"route": 0.0, "dispatch": 0.0}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def install(self, llm: LLM) -> None:
        for module in llm.engine.runner.model.modules():
            if isinstance(module, SparseMoE):
                module.route = self.wrap("route", module.route)  # type: ignore[method-assign]
                module.dispatch = self.wrap("dispatch", module.dispatch)  # type: ignore[method-assign]


def run_tokenmill(
    folder: Path,
    streams: int,
    prompt_len: int,
    max_tokens: int,
    num_threads: int | None,
    dtype: str = "float32",
) -> dict[str, Any]:
    llm = LLM(
        str(folder),
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=max(16, streams),
        num_threads=num_threads,
    )
    warm_up(llm)
    timer = StepTimer()
    timer.install(llm)
    result, _ = timed_batch(llm, streams, prompt_len, max_tokens, seed=streams)
    return {
        "streams": streams,
        "output_tok_s": result["output_tok_s"],
        "elapsed_s": result["wall_s"],
        "route_share": timer.seconds["route"] / result["wall_s"],
        "dispatch_share": timer.seconds["dispatch"] / result["wall_s"],
    }


def run_transformers(
    folder: Path, streams: int, prompt_len: int, max_tokens: int, dtype: str = "float32"
) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype)
    ).eval()
    model.generation_config.eos_token_id = None
    rng = random.Random(streams)
    ids = torch.tensor(
        [[rng.randrange(4, 30000) for _ in range(prompt_len)] for _ in range(streams)]
    )
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
    return {
        "streams": streams,
        "output_tok_s": streams * max_tokens / elapsed,
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/bench/moe"))
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an existing MoE folder to run (e.g. peers_run.py's); default: built from "
        "--shape as --model-dir-SHAPE",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--with-transformers", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for both sides (default: the engine's, one per physical core)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = args.model or build_model(
        args.model_dir.with_name(f"{args.model_dir.name}-{args.shape}"), SHAPES[args.shape]
    )
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    result: dict[str, Any] = {
        "shape": args.shape if args.model is None else str(args.model),
        "dtype": args.dtype,
        "threads": args.num_threads,
        "workload": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "tokenmill": [],
    }
    for streams in args.streams:
        result["tokenmill"].append(
            run_tokenmill(
                folder, streams, args.prompt_len, args.max_tokens, args.num_threads, args.dtype
            )
        )
        print(json.dumps(result["tokenmill"][-1]))
    if args.with_transformers:
        result["transformers"] = [
            run_transformers(folder, s, args.prompt_len, args.max_tokens, args.dtype)
            for s in args.streams
        ]
        print(json.dumps(result["transformers"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
