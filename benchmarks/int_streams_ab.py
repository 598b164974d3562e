"""16-stream decode of the 250M benchmark Llama: int8 / int4 against bf16, in one process.

The target: with ``--quantization int8`` and ``int4`` (bf16 activations) throughput at
16 streams at least bf16's. One in-process engine per configuration (paged KV, bf16), all
loaded side by side; each round gives every engine the same 16 requests (a 128-token prompt,
64 output tokens, greedy, EOS ignored) at once, the engines alternating and their order
reversed every other round. Reported per engine: the median decode step (steps after every
request's prefill) and output tokens per second over the round, as medians over rounds, and
ratios to bf16. The start-up log names the int kernel (``kernels.describe``).

    PYTHONPATH=src .venv/bin/python benchmarks/int_streams_ab.py --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

from tokenmill import kernels
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

DEFAULT_MODEL_DIR = Path.home() / ".cache/tokenmill/bench-llama-250m"


def build(quant: str, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=str(args.model_dir),
            dtype="bfloat16",
            max_num_seqs=args.streams,
            max_model_len=args.prompt_len + args.output_len + 8,
            kv_cache_memory=float(1 << 30),  # bytes
            num_threads=args.threads,
            quantization=None if quant == "bf16" else quant,
        )
    )


def one_round(engine: LLMEngine, tag: str, args: argparse.Namespace) -> tuple[float, float]:
    """(median decode step in ms, output tokens per second) for one batch of requests."""
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.streams):
        prompt = [4 + (t * 31 + i * 997) % 31000 for t in range(args.prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps: list[tuple[float, int]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, len(outs)))
    total = time.perf_counter() - start
    decode = [s for s, _ in steps[-(args.output_len - 2) :]]
    return 1e3 * statistics.median(decode), args.streams * args.output_len / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["bf16", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {name: build(name, args) for name in args.configs}
    print(kernels.describe())
    for name, engine in engines.items():  # warm-up
        one_round(engine, f"warm-{name}", args)
    step_ms: dict[str, list[float]] = {n: [] for n in engines}
    tok_s: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(args.rounds):
        for name in args.configs if r % 2 == 0 else args.configs[::-1]:
            ms, rate = one_round(engines[name], f"r{r}-{name}", args)
            step_ms[name].append(ms)
            tok_s[name].append(rate)
    base = args.configs[0]
    base_ms, base_rate = statistics.median(step_ms[base]), statistics.median(tok_s[base])
    print(f"--threads {args.threads}, {args.streams} streams, {args.rounds} rounds (medians)")
    for name in args.configs:
        ms, rate = statistics.median(step_ms[name]), statistics.median(tok_s[name])
        print(
            f"{name:>5}: decode step {ms:7.2f} ms ({base_ms / ms:4.2f}x {base})  "
            f"{rate:7.1f} tok/s ({rate / base_rate:4.2f}x)  steps {[round(v, 1) for v in step_ms[name]]}"
        )


if __name__ == "__main__":
    main()
