"""Where one stream's decode step goes, without a profiler: wall time per op family.

The in-process engine (eager ``paged``) decodes one 128 -> 64 request of the 250M benchmark
Llama twice; each decode step is timed whole, and so are the calls of the Python entry
points it makes (the int or bf16 projections, LM head included; decode attention; RMSNorm;
RoPE + KV write; SiLU*mul; the model's forward). torch.profiler adds ~10 us an op, which
at one stream is as much as many ops cost; these wrappers add a ``perf_counter`` pair.
Medians over the steps after the first decode. Under ``PYTHONPATH`` of another tree it
measures that tree (A/B by alternating runs).

    PYTHONPATH=src .venv/bin/python benchmarks/step_ops.py --quantization int8
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch

from tokenmill import kernels
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model import attention, decoder, layers, quant

MODEL = Path.home() / ".cache/tokenmill/bench-llama-250m"
times: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``times[key]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        times[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", choices=["bf16", "int8", "int4"], default="int8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(MODEL),
            dtype="bfloat16",
            max_num_seqs=4,
            max_model_len=args.prompt_len + 80,
            num_threads=args.threads,
            quantization=None if args.quantization == "bf16" else args.quantization,
        )
    )
    timed(quant.QuantizedLinear, "forward", "int projections")
    timed(layers.Linear, "forward", "bf16 projections")
    timed(attention, "_decode_kernel", "decode attention")
    for name in ("rms_norm", "silu_and_mul", "rope_kv_write"):
        timed(kernels, name, name)
    timed(decoder.DecoderModel, "forward", "model forward")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = [4 + (t * 31) % 31000 for t in range(args.prompt_len)]
    steps: list[float] = []
    per_step: list[dict[str, float]] = []
    for rep in range(2):  # the first request warms up
        engine.add_request(f"r{rep}", prompt, params)
        steps, per_step = [], []
        while engine.has_unfinished_requests():
            times.clear()
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
            per_step.append(dict(times))
    decode = per_step[2:]
    print(f"step {1e3 * statistics.median(steps[2:]):.3f} ms")
    for key in sorted({k for step in decode for k in step}):
        print(f"  {key:18s} {1e3 * statistics.median(s.get(key, 0.0) for s in decode):.3f} ms")


if __name__ == "__main__":
    main()
