"""Where the long-prompt workload's time goes, in process: prompt steps against decode steps.

The long-prompt target (16 x (1024 -> 64) at 8 streams, the 250M Llama, against vLLM CPU)
is one workload served; this runs the same requests through one ``LLMEngine`` (bf16, paged,
``max_num_seqs`` 8, greedy, EOS ignored, distinct prompts so no prefix-cache hits) and splits
its wall time by step: a step that computed more than 64 prompt tokens is a prompt step (with
whatever decode rows rode along), every other a decode step. Two requests run first to warm
the kernels and the allocator. Run it in each tree to compare (``PYTHONPATH=TREE/src``), the
trees alternating, since a shared VM's bandwidth drifts between runs:

    PYTHONPATH=src .venv/bin/python benchmarks/long_prompt_steps.py [--model-dir DIR] [--json F]

``--max-num-batched-tokens`` runs it at another step budget (smaller budgets carry decode
rows in more prompt steps, at the price of more, smaller prompt chunks); ``--quantization``
at int8 or int4 weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import tokenmill  # first: it sets the OpenMP wait policy before torch loads the runtime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_core import DEFAULT_MODEL_DIR, build_model

from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS, STREAMS = 1024, 64, 16, 8


def run(
    model_dir: Path, max_num_batched_tokens: int | None = None, quantization: str | None = None
) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            dtype="bfloat16",
            quantization=quantization,
            kv_cache="paged",
            max_num_seqs=STREAMS,
            max_model_len=2048,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    vocab = engine.model_config.vocab_size - 4

    def add(tag: str, count: int, salt: int) -> None:
        for i in range(count):
            prompt = [4 + (i * 7919 + t * 31 + salt) % vocab for t in range(PROMPT_TOKENS)]
            engine.add_request(f"{tag}{i}", prompt, params)

    add("warm", 2, 500)
    while engine.has_unfinished_requests():
        engine.step()
    add("r", REQUESTS, 0)
    prompt_steps: list[float] = []
    decode_steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        requests = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        before = {r.request_id: r.num_computed_tokens for r in requests}
        t0 = time.perf_counter()
        engine.step()
        took = time.perf_counter() - t0
        prompt_tokens = sum(
            min(r.num_computed_tokens, PROMPT_TOKENS) - min(before[r.request_id], PROMPT_TOKENS)
            for r in requests
        )
        (prompt_steps if prompt_tokens > 64 else decode_steps).append(took)
    total = time.perf_counter() - start
    return {
        "total_s": round(total, 3),
        "output_tok_s": round(REQUESTS * OUTPUT_TOKENS / total, 2),
        "prompt_steps": len(prompt_steps),
        "prompt_steps_s": round(sum(prompt_steps), 3),
        "prompt_step_median_ms": round(1e3 * statistics.median(prompt_steps), 1),
        "decode_steps": len(decode_steps),
        "decode_steps_s": round(sum(decode_steps), 3),
        "decode_step_median_ms": round(1e3 * statistics.median(decode_steps), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--json", type=Path, help="also append the row to this JSON-lines file")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the step's token budget (default: the engine's, 1024 on a CPU)",
    )
    parser.add_argument("--quantization", choices=("int8", "int4"), help="default: bf16 weights")
    args = parser.parse_args()
    model_dir = (
        build_model(args.model_dir) if args.model_dir == DEFAULT_MODEL_DIR else args.model_dir
    )
    row = {
        "tree": tokenmill.__file__,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "quantization": args.quantization,
        **run(model_dir, args.max_num_batched_tokens, args.quantization),
    }
    print(json.dumps(row))
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
