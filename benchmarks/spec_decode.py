"""Speculative decoding benchmark (issue 21): n-gram speculation on a copy-heavy workload.

Prompts ask the demo model to rewrite a passage of the demo corpus, so good answers repeat
the prompt and prompt lookup has something to find. Each configuration runs the same
greedy requests in the offline engine without speculation, with n-gram speculation and
with the draft model (``demo-draft`` for the demo: its first 2 of 4 layers, untrained):

  1 stream    requests one after another (what one chat user feels: TPOT)
  16 streams  16 requests at once (the policy turns speculation down for a full batch)

Reported per run: output tok/s, mean TPOT (per request: (last - first token) / (tokens - 1)),
and, with speculation, the acceptance rate (accepted / drafted tokens) and the mean
accepted length (tokens per verifying step of a request: 1 + accepted / drafts).

    .venv/bin/python benchmarks/spec_decode.py --out results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.model.demo import DEMO_CORPUS


def copy_prompts(num: int, lines_per_prompt: int = 2) -> list[str]:
    """ "Rewrite this text" prompts over consecutive corpus lines (wrapping around)."""
    lines = DEMO_CORPUS.strip().splitlines()
    prompts = []
    for i in range(num):
        passage = " ".join(lines[(i + j) % len(lines)] for j in range(lines_per_prompt))
        prompts.append(f"Rewrite this text: {passage}\nRewritten: {passage.split('.')[0]}")
    return prompts


def run(llm: LLM, prompts: list[str], params: SamplingParams, streams: int) -> dict[str, Any]:
    """Requests ``streams`` at a time; figures from the engine's own request timestamps."""
    engine = llm.engine
    before = engine.stats
    tpots: list[float] = []
    num_out = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), streams):
        for out in llm.generate(prompts[first : first + streams], params, use_tqdm=False):
            metrics = out.metrics
            tokens = len(out.outputs[0].token_ids)
            num_out += tokens
            if metrics is not None and tokens > 1 and metrics.first_token_time is not None:
                assert metrics.last_token_time is not None
                tpots.append((metrics.last_token_time - metrics.first_token_time) / (tokens - 1))
    elapsed = time.perf_counter() - start
    after = engine.stats
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "streams": streams,
        "num_requests": len(prompts),
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "mean_tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "steps": after.num_steps - before.num_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--draft-model", default="demo-draft")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = copy_prompts(args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    results: dict[str, Any] = {"config": vars(args) | {"out": str(args.out)}, "runs": []}
    draft = {"model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    configs: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("ngram", {"speculative_config": spec}),
        ("draft_model", {"speculative_config": draft}),
    ]
    for label, options in configs:
        llm = LLM(args.model, max_model_len=512, **options)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        for streams in args.streams:
            row = {"config": label, **run(llm, prompts, params, streams)}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
