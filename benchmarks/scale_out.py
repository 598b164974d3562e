"""Scale-out costs, measured in one run:

executor   the in-process executor (plan diff + worker mirror) against calling the runner
           directly as the engine did before the Worker split, same engine, same process,
           rounds interleaved; 1 and 16 decode streams.
allreduce  gloo all-reduce of one step's activations between 2 local processes:
           [rows, hidden] fp32, per call and per step (2 per layer + embedding + logits).
tp         TP=2 x 1 thread against TP=1 x 2 threads through the engine (decode tok/s).

  .venv/bin/python benchmarks/scale_out.py --shape small --out results/scale_out.json
  .venv/bin/python benchmarks/scale_out.py --shape 250m   # the benchmark Llama (built once)
  .venv/bin/python benchmarks/scale_out.py --shape tiny --rounds 1 --out-tokens 4  # smoke only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenmill  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads the runtime)

# isort: split
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import DEFAULT_MODEL_DIR, MODEL_SHAPE

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=512,
)
"""For smoke-testing the script only (``--shape tiny``); its numbers mean nothing."""
SMALL_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=1024,
)


def build(folder: Path, shape: dict[str, int]) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import transformers

    from tokenmill.model.demo import build_bpe_tokenizer

    cfg = transformers.LlamaConfig(
        **shape, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_bpe_tokenizer(folder, vocab_size=min(2048, shape["vocab_size"]))
    return folder


def _decode_run(llm: LLM, streams: int, out_tokens: int) -> float:
    """Decode tokens per second for ``streams`` requests of 32 prompt tokens."""
    vocab = llm.engine.model_config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 4) + 4 for j in range(32)] for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return streams * out_tokens / (time.perf_counter() - start)


def bench_executor(folder: Path, rounds: int, out_tokens: int) -> dict[str, Any]:
    llm = LLM(str(folder), dtype="float32", max_model_len=512, num_threads=2)
    engine = llm.engine
    execute = engine.executor.execute_model
    worker_execute = engine.executor.driver_worker.execute_model  # type: ignore[attr-defined]

    def direct(on: bool) -> None:
        """on: the engine calls its worker directly, around the executor."""
        engine.executor.execute_model = worker_execute if on else execute  # type: ignore[method-assign]

    result: dict[str, Any] = {}
    for streams in (1, 16):
        _decode_run(llm, streams, 8)  # warm-up
        got: dict[str, list[float]] = {"executor": [], "direct": []}
        for _ in range(rounds):
            for mode in ("executor", "direct"):
                direct(mode == "direct")
                got[mode].append(_decode_run(llm, streams, out_tokens))
        direct(False)
        ex, di = statistics.median(got["executor"]), statistics.median(got["direct"])
        result[f"{streams}_streams"] = {
            "executor_tok_s": round(ex, 1),
            "direct_tok_s": round(di, 1),
            "overhead_pct": round(100 * (di - ex) / di, 2),
            "rounds": got,
        }
    return result


def bench_diff_cost(streams: int = 16, context: int = 512, steps: int = 200) -> dict[str, Any]:
    """What the executor seam adds per decode step, without a model: apply a real
    scheduler's diff to the worker's mirror (in-process, and encoded to msgpack and decoded
    as the mp executor does). Writing the diff is part of ``schedule`` and not counted."""
    from tokenmill.core.kv.paged import PagedKVManager
    from tokenmill.core.messages import decode_plan, encode, plan_for_wire
    from tokenmill.core.request import Request
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.worker.request_state import RequestStates

    result: dict[str, Any] = {"streams": streams, "context": context}
    for label, in_process in (("in_process", True), ("msgpack", False)):
        kv = PagedKVManager(streams * (context + steps) // 16 + 64, 16)
        sched = Scheduler(kv, streams, 8192)
        for i in range(streams):
            prompt = [(i * 31 + j) % 30000 + 4 for j in range(context)]
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=10**6)))
        states = RequestStates()
        spent, frame_bytes = 0.0, 0
        for step in range(steps + 1):
            out = sched.schedule()
            start = time.perf_counter()
            plan = out.plan
            if not in_process:
                frame = encode(plan_for_wire(plan))
                frame_bytes = len(frame)
                plan = decode_plan(frame)
            states.apply(plan)
            if step > 0:  # step 0 is the prefill (new requests)
                spent += time.perf_counter() - start
            sched.update_after_step(out.scheduled)
            for request, _ in out.scheduled:
                request.append_output_token(5)
        result[label] = {
            "us_per_step": round(spent / steps * 1e6, 1),
            "decode_frame_bytes": frame_bytes,
        }
    return result


def _allreduce_worker(
    rank: int, port: int, rows: list[int], hidden: int, iters: int, out: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for n in rows:
        x = torch.randn(n, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        times[n] = (time.perf_counter() - start) / iters * 1e6
    if rank == 0:
        out.update(times)
    dist.destroy_process_group()


def bench_allreduce(hidden: int, layers: int, iters: int) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = [1, 16, 256]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_worker, args=(port, rows, hidden, iters, out), nprocs=2)
        per_call = dict(out)
    calls_per_step = 2 * layers + 1  # attention + MLP per layer, the embedding
    return {
        "hidden": hidden,
        "per_call_us": {str(n): round(us, 1) for n, us in per_call.items()},
        "per_step_ms": {str(n): round(us * calls_per_step / 1e3, 2) for n, us in per_call.items()},
        "calls_per_step": calls_per_step,
        "note": "plus one all-gather of the logits rows per step",
    }


def bench_tp(folder: Path, out_tokens: int) -> dict[str, Any]:
    """Decode tok/s of both layouts (on a 2-core machine TP cannot win: it shows the cost)."""
    result = {}
    for label, tp, threads in (("tp1x2threads", 1, 2), ("tp2x1thread", 2, 1)):
        llm = LLM(
            str(folder),
            dtype="float32",
            max_model_len=512,
            tensor_parallel_size=tp,
            num_threads=threads,
        )
        try:
            _decode_run(llm, 1, 4)
            result[label] = {
                "1_stream_tok_s": round(_decode_run(llm, 1, out_tokens), 1),
                "16_streams_tok_s": round(_decode_run(llm, 16, out_tokens), 1),
            }
        finally:
            llm.engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=["tiny", "small", "250m"], default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-tokens", type=int, default=32)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["diff", "executor", "allreduce", "tp"]
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shape = {"tiny": TINY_SHAPE, "small": SMALL_SHAPE, "250m": MODEL_SHAPE}[args.shape]
    folder = (
        DEFAULT_MODEL_DIR
        if args.shape == "250m"
        else Path(tempfile.gettempdir()) / f"tokenmill-bench-llama-{args.shape}"
    )
    folder = build(folder, shape)
    report: dict[str, Any] = {"shape": args.shape, "model": shape}
    if "diff" not in args.skip:
        report["diff"] = bench_diff_cost()
        print(json.dumps(report["diff"], indent=1), flush=True)
    if "executor" not in args.skip:
        report["executor"] = bench_executor(folder, args.rounds, args.out_tokens)
        print(json.dumps(report["executor"], indent=1), flush=True)
    if "allreduce" not in args.skip:
        report["allreduce"] = bench_allreduce(shape["hidden_size"], shape["num_hidden_layers"], 200)
        print(json.dumps(report["allreduce"], indent=1), flush=True)
    if "tp" not in args.skip:
        report["tp"] = bench_tp(folder, args.out_tokens)
        print(json.dumps(report["tp"], indent=1), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
