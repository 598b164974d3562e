"""Beam-queue isolation: standard requests' TTFT with the beam search queue idle vs saturated.

Beam search runs from its own queue with its own concurrency quota
(``--max-beam-search-requests``), so a saturated beam queue must not move the standard
requests' TTFT beyond the shared-compute effect (beams that do run share the batch).

One run, one engine per configuration, each in two phases with the same Poisson stream of
standard requests (greedy, ``--std-max-tokens``):
  idle       no beam search request at all
  saturated  the beam queue is kept full (``--beam-backlog`` requests unfinished at all times)
Configurations: ``own queue`` (the quota, ``--quota``) and, for contrast, ``no quota``
(quota above the backlog: only the engine's bound of ``--max-num-seqs`` beams limits them, so
beam requests fill the running batch, as they would sharing the standard queue).

The engine is stepped on this thread, and requests are added when their arrival time
has passed, so TTFT is measured in wall-clock time from arrival to the first token, as the
server would see it (minus HTTP).

    .venv/bin/python benchmarks/beam_isolation.py --out results/beam_isolation.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine


@dataclass
class PhaseResult:
    """Standard-request TTFT over one phase."""

    config: str
    phase: str
    num_standard: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    num_beam_finished: int
    mean_running_beams: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(
    engine: LLMEngine, args: argparse.Namespace, config: str, phase: str, seed: int
) -> PhaseResult:
    rng, prompt_rng, beam_rng = (
        random.Random(seed),
        random.Random(seed + 1),
        random.Random(seed + 2),
    )
    vocab = engine.model_config.vocab_size
    std = SamplingParams(temperature=0.0, max_tokens=args.std_max_tokens, ignore_eos=True)
    beam = SamplingParams(
        n=1,
        best_of=args.beam_width,
        use_beam_search=True,
        max_tokens=args.beam_max_tokens,
        ignore_eos=True,
    )

    def prompt(source: random.Random) -> list[int]:
        return [source.randrange(4, vocab) for _ in range(args.prompt_len)]

    engine.kv_manager.reset_prefix_cache()  # both phases send the same prompts

    start = time.monotonic()
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration_s:
            break
        arrivals.append(start + t)
    pending = list(enumerate(arrivals))
    arrived: dict[str, float] = {}
    ttft_s: dict[str, float] = {}
    beam_ids: set[str] = set()
    num_beam_finished = 0
    running_beams: list[int] = []
    next_beam = 0
    while pending or len(ttft_s) < len(arrivals):
        now = time.monotonic()
        while pending and pending[0][1] <= now:
            i, at = pending.pop(0)
            rid = f"{phase}-std{i}"
            engine.add_request(rid, prompt(prompt_rng), std, arrival_time=at)
            arrived[rid] = at
        if phase == "saturated":
            while next_beam - num_beam_finished < args.beam_backlog:  # keep the backlog full
                rid = f"{phase}-beam{next_beam}"
                next_beam += 1
                engine.add_request(rid, prompt(beam_rng), beam)
                beam_ids.add(rid)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0][1] - now)) if pending else 0.0)
            continue
        outputs = engine.step()
        done = time.monotonic()
        running_beams.append(sum(1 for r in engine.scheduler.running if r.parent_id in beam_ids))
        for out in outputs:
            if out.request_id in beam_ids:
                num_beam_finished += out.finished
            elif out.request_id not in ttft_s and any(c.token_ids for c in out.outputs):
                ttft_s[out.request_id] = done - arrived[out.request_id]
    engine.abort_request(sorted(beam_ids))  # end the backlog before the next phase
    while engine.has_unfinished_requests():
        engine.step()
    values = [v * 1000 for v in ttft_s.values()]
    return PhaseResult(
        config=config,
        phase=phase,
        num_standard=len(values),
        ttft_p50_ms=statistics.median(values),
        ttft_p95_ms=_percentile(values, 0.95),
        num_beam_finished=num_beam_finished,
        mean_running_beams=statistics.fmean(running_beams) if running_beams else 0.0,
    )


def warm_up(engine: LLMEngine, args: argparse.Namespace) -> None:
    """First calls are slow (kernel selection, allocator growth): keep them out of the phases."""
    beam = SamplingParams(best_of=args.beam_width, use_beam_search=True, max_tokens=8)
    std = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(args.max_num_seqs):
        engine.add_request(f"warm{i}", [5 + i] * args.prompt_len, beam if i < 2 else std)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--quota", type=int, default=2, help="--max-beam-search-requests")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-max-tokens", type=int, default=64)
    parser.add_argument("--beam-backlog", type=int, default=16)
    parser.add_argument("--rate", type=float, default=8.0, help="standard requests per second")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--std-max-tokens", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    results: list[PhaseResult] = []
    configs = {
        f"own queue (quota {args.quota})": args.quota,
        "no quota": args.beam_backlog + args.max_num_seqs,
    }
    for name, quota in configs.items():
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                max_num_seqs=args.max_num_seqs,
                max_beam_search_requests=quota,
                num_threads=args.num_threads,
            )
        )
        warm_up(engine, args)
        for phase in ("idle", "saturated"):
            results.append(run_phase(engine, args, name, phase, seed=0))
            r = results[-1]
            print(
                f"{r.config:22} {r.phase:10} n={r.num_standard:4d}  TTFT p50 {r.ttft_p50_ms:7.1f} ms"
                f"  p95 {r.ttft_p95_ms:7.1f} ms  beams running {r.mean_running_beams:5.1f}"
                f"  beam requests done {r.num_beam_finished}",
                flush=True,
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "results": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
