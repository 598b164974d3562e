"""Structured-outputs benchmark: grammar compile time, per-step mask cost, and
serving throughput of a JSON-schema workload against the same workload unconstrained.

  compile  GrammarCompiler on the demo tokenizer: cold (new compiler) and cached compile of
           the workload schema and two bigger ones; llguidance's per-step mask cost, and
           xgrammar's beside it when installed (the comparison behind choosing llguidance)
  serve    one ``tokenmill serve demo``; ``tokenmill bench serve`` at 16 concurrent streams,
           first with ``response_format: json_schema`` (output length set by the schema),
           then unconstrained with ``--ignore-eos`` and max_tokens = the JSON run's mean
           output length, so both generate about as many tokens; output tok/s and TPOT

    .venv/bin/python benchmarks/structured_outputs.py --out results/structured_outputs.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["file", "dir", "link"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}
WORKLOAD_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 6, "maxItems": 6}},
    "required": ["items"],
    "additionalProperties": False,
}
WIDE_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": ITEM for i in range(200)},
    "additionalProperties": False,
}


def _demo_tokenizer_json() -> str:
    from tokenmill.model.demo import demo_model_path

    return (demo_model_path() / "tokenizer.json").read_text()


def measure_compile(repeats: int = 5) -> dict[str, Any]:
    """Cold and cached compile times (ms) and per-step mask cost (us) on the demo vocab."""
    import llguidance
    import llguidance.torch as llg_torch

    from tokenmill.core.structured_params import StructuredOutputsParams
    from tokenmill.structured.grammar import GrammarCompiler

    text = _demo_tokenizer_json()
    result: dict[str, Any] = {}
    start = time.perf_counter()
    GrammarCompiler(text, 2048, [1, 3]).tokenizer  # noqa: B018
    result["tokenizer_build_ms"] = (time.perf_counter() - start) * 1e3
    for name, schema in (("workload", WORKLOAD_SCHEMA), ("wide_200_fields", WIDE_SCHEMA)):
        cold, cached = [], []
        for _ in range(repeats):
            compiler = GrammarCompiler(text, 2048, [1, 3])
            compiler.tokenizer  # noqa: B018  (built outside the timed compile)
            params = StructuredOutputsParams(json=schema)
            start = time.perf_counter()
            compiler.compile(params)
            cold.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(schema))))
            cached.append((time.perf_counter() - start) * 1e3)
        result[f"{name}_cold_ms"] = statistics.median(cold)
        result[f"{name}_cached_ms"] = statistics.median(cached)

    compiler = GrammarCompiler(text, 2048, [1, 3])
    sample = json.dumps(
        {"items": [{"name": "a.txt", "size": 12, "kind": "file", "ok": True}] * 6},
        separators=(",", ":"),
    )
    tokens = compiler.tokenizer.tokenize_str(sample)
    matcher = compiler.compile(StructuredOutputsParams(json=WORKLOAD_SCHEMA)).new_matcher()
    bitmask = llg_torch.allocate_token_bitmask(1, 2048)
    start = time.perf_counter()
    for token in tokens:
        llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
        matcher.consume_token(token)
    result["llguidance_mask_us_per_step"] = (time.perf_counter() - start) / len(tokens) * 1e6
    result["num_steps"] = len(tokens)
    result["llguidance_version"] = llguidance.__version__
    result.update(_xgrammar_steps(text, sample))
    return result


def _xgrammar_steps(tokenizer_json: str, sample: str) -> dict[str, Any]:
    """xgrammar's compile and per-step mask cost on the same vocab, when it is installed."""
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokenizer.json"
        path.write_text(tokenizer_json)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=2048, stop_token_ids=[1, 3])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(WORKLOAD_SCHEMA))
    cold_ms = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, 2048)
    tokens = hf.encode(sample, add_special_tokens=False)
    start = time.perf_counter()
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask, 0)
        matcher.accept_token(token)
    return {
        "xgrammar_workload_cold_ms": cold_ms,
        "xgrammar_mask_us_per_step": (time.perf_counter() - start) / len(tokens) * 1e6,
    }


# ---- serving --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_serve(
    base_url: str, out: Path, output_len: int, num_prompts: int, extra: list[str]
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve",
        "--base-url", base_url, "--dataset", "random", "--num-prompts", str(num_prompts),
        "--input-len", "64", "--output-len", str(output_len), "--max-concurrency", "16",
        "--num-warmups", "4", "--no-progress", "--save-result", str(out), *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def _pick(result: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "completed",
        "failed",
        "output_throughput",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_ttft_ms",
        "total_output_tokens",
    )
    return {k: result.get(k) for k in keys}


def measure_serve(out_dir: Path, num_threads: int, num_prompts: int) -> dict[str, Any]:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(out_dir / "structured_server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "demo",
         "--port", str(port), "--max-num-seqs", "16", "--num-threads", str(num_threads)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    try:
        body = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "listing", "schema": WORKLOAD_SCHEMA},
            }
        }
        constrained = _bench_serve(
            base_url,
            out_dir / "structured_json.json",
            512,
            num_prompts,
            ["--extra-body", json.dumps(body)],
        )
        mean_len = round(constrained["total_output_tokens"] / max(constrained["completed"], 1))
        plain = _bench_serve(
            base_url, out_dir / "structured_plain.json", mean_len, num_prompts, ["--ignore-eos"]
        )
    finally:
        server.terminate()
        server.wait()
        log.close()
    json_run, plain_run = _pick(constrained), _pick(plain)
    return {
        "json_schema": json_run,
        "unconstrained": plain_run,
        "throughput_ratio": (json_run["output_throughput"] or 0)
        / (plain_run["output_throughput"] or 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="compile,serve", help="compile, serve or both")
    parser.add_argument("--num-threads", type=int, default=2, help="server torch threads")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per serve run")
    parser.add_argument("--out", default="results/structured_outputs.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {}
    if "compile" in parts:
        result["compile"] = measure_compile()
        print(json.dumps(result["compile"], indent=2))
    if "serve" in parts:
        result["serve"] = measure_serve(out.parent, args.num_threads, args.num_prompts)
        print(json.dumps(result["serve"], indent=2))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
