"""Speculative decoding benchmark: tokenmill, llama.cpp and vLLM CPU in one run.

Every engine is started as an OpenAI-compatible server and driven by the same streaming
client, greedy, ``ignore_eos``, the same prompts:

  copy  "Rewrite this text: <passage>" prompts whose answers repeat the prompt (where
        n-gram speculation, prompt lookup, has something to find; ``copy_workload.py``
        says how the passages make the demo's greedy answer repeat them)
  text  the corpus lines themselves, continued (where only a draft model can guess)

Server configurations (each at 1 stream, requests one after another, and at 16 streams):

  tokenmill          plain / ngram / draft_model (``demo-draft``, the trained one-layer draft)
  llama.cpp          plain / ngram-simple / draft (``llama-server -md``), the same pair as GGUF
  vLLM CPU           plain / ngram (``--speculative-config``), if it starts

Every server is started at once, each on its own port (idle, none costs CPU), and
``--rounds`` rounds visit them in an order rotated per round; rows are the rounds' medians
(each round's TPOT is in the JSON), so a noisy minute hits every configuration alike.

Reported per row: output tok/s, mean TPOT (per request: (last - first token) / (tokens -
1)), mean TTFT, and with speculation the acceptance rate (accepted / drafted tokens) and
the mean accepted length (tokens per verifying step of a request: 1 + accepted / drafts),
from each server's own counters (tokenmill and vLLM: ``/metrics``; llama.cpp: the
``timings`` of each response, which count drafted and accepted tokens but not drafts).

    .venv/bin/python benchmarks/spec_decode.py --out results/spec_decode.json
    # smoke: .venv/bin/python benchmarks/spec_decode.py --num-requests 2 --max-tokens 8 \\
    #     --streams 1 2 --engines tokenmill --out /tmp/spec.json

The GGUF files come from ``benchmarks/gguf_convert_demo.py`` (see its docstring
for the python to run it with; ``--gguf-dir``, names ``tm-demo-f32.gguf`` and ``tm-demo-draft-f32.gguf``); vLLM
from its venv (``--vllm-python``; vLLM 0.32 CPU accepts ngram ``--speculative-config`` and
warns that without Intel OpenMP in LD_PRELOAD speculation loses much of its speed). A peer that is missing or does not start is a row saying why.
Writes the JSON (``--out``) and a markdown table beside it (``.md``) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.model.demo import DEMO_CORPUS, demo_draft_path, demo_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_workload import copy_corpus_prompts, copy_prompts

PEERS = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache" / "tokenmill-peers"))


def text_prompts(num: int) -> list[str]:
    """A corpus line each (wrapping around), to be continued."""
    lines = DEMO_CORPUS.strip().splitlines()
    return [lines[(7 * i) % len(lines)] for i in range(num)]


WORKLOADS = {"copy": copy_prompts, "text": text_prompts, "copy_corpus": copy_corpus_prompts}


@dataclass
class Server:
    """One engine configuration to start, with how to read its speculation counters."""

    engine: str
    label: str
    cmd: list[str]
    counters: str
    """``tokenmill`` or ``vllm`` (/metrics prefixes), ``llamacpp`` (per-response timings)."""
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float = 300.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.cmd[self.cmd.index('--port') + 1]}"


LLAMACPP_NGRAM = ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m"]
"""llama-server's best n-gram speculation on ``copy`` (one stream, 2026-12-02, measured by
hand): ngram-simple with a 3-token lookup and k-token drafts, 1.01 ms TPOT, against 1.16 for
its default 12-token lookup, 1.02-1.08 for n = 2 or 4, ngram-map-k 1.08, ngram-cache 1.18
and ngram-mod 1.37 (plain 1.39). The default drafted nothing it could log."""


def servers(args: argparse.Namespace, port: int) -> list[Server]:
    k = args.num_speculative_tokens
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    draft = {"model": args.draft_model, "num_speculative_tokens": k}
    out: list[Server] = []
    if "tokenmill" in args.engines:
        base = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", args.model]
        base += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024"]
        base += ["--max-num-seqs", "16", "--dtype", args.dtype, *args.tokenmill_flags]
        out += [
            Server("tokenmill", "plain", base, "tokenmill"),
            Server(
                "tokenmill",
                "ngram",
                base + ["--speculative-config", json.dumps(ngram)],
                "tokenmill",
            ),
            Server(
                "tokenmill",
                "draft",
                base + ["--speculative-config", json.dumps(draft)],
                "tokenmill",
            ),
        ]
    gguf = args.gguf_dir
    llama = PEERS / "build-llama" / "bin" / "llama-server"
    if "llamacpp" in args.engines:
        target, drafter = (
            gguf / f"tm-demo-{args.gguf_type}.gguf",
            gguf / f"tm-demo-draft-{args.gguf_type}.gguf",
        )
        base = [str(llama), "-m", str(target), "--host", "127.0.0.1", "--port", str(port)]
        base += ["-t", str(args.threads or os.cpu_count() or 1), "-np", "16", "-c", "16384", "-cb"]
        spec = ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
        out += [
            Server("llama.cpp", "plain", base, "llamacpp"),
            Server(
                "llama.cpp",
                "ngram",
                base + ["--spec-type", "ngram-simple", *LLAMACPP_NGRAM, str(k)],
                "llamacpp",
            ),
            Server(
                "llama.cpp",
                "draft",
                base + ["-md", str(drafter), "--spec-type", "draft-simple", *spec],
                "llamacpp",
            ),
        ]
    if "vllm" in args.engines:
        threads = args.threads or os.cpu_count() or 1
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        base = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        base += ["--model", str(args.model_dir), "--served-model-name", args.model]
        base += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024"]
        base += ["--max-num-seqs", "16", "--dtype", args.dtype]
        out += [
            Server("vLLM CPU", "plain", base, "vllm", env, 600),
            Server(
                "vLLM CPU",
                "ngram",
                base + ["--speculative-config", json.dumps(ngram)],
                "vllm",
                env,
                600,
            ),
        ]
    return [s for s in out if s.label in args.configs]


# ------------------------------------------------------------------------------- running


def start(server: Server, log_path: Path) -> subprocess.Popen[bytes] | str:
    """The server process once /health answers 200, or why it did not start."""
    if not Path(server.cmd[0]).exists() and "/" in server.cmd[0]:
        return f"{server.cmd[0]} not found"
    for arg in server.cmd:
        if arg.endswith(".gguf") and not Path(arg).is_file():
            return f"{arg} not found (build-llamacpp.sh convert)"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server.cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env}
        )
    port = server.cmd[server.cmd.index("--port") + 1]
    deadline = time.monotonic() + server.startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            return f"exited with {process.returncode}: {' | '.join(tail)}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    return f"not healthy after {server.startup_s:.0f}s"


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def metrics(base_url: str) -> dict[str, float]:
    """Sums of every /metrics sample by name (labels summed over)."""
    values: dict[str, float] = {}
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return values
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            with contextlib.suppress(ValueError):
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {c: values.get(f"{prefix}:spec_decode_{c}_total", 0.0) for c in SPEC_COUNTERS}


def one_request(base_url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion: first and last token times, tokens, llama.cpp timings."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens, timings = None, None
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
            timings = chunk.get("timings") or timings
    return {
        "sent": sent,
        "first": first,
        "last": last,
        "tokens": tokens or max_tokens,
        "timings": timings,
    }


LLAMACPP_DRAFTS = re.compile(
    r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([\d.]+)"
)
"""llama-server's line per finished request (its ``timings`` lack the number of drafts)."""


def llamacpp_counters(log_text: str) -> dict[str, float]:
    """Drafts (verifying steps), drafted and accepted tokens from llama-server log lines."""
    drafts = drafted = accepted = 0.0
    for match in LLAMACPP_DRAFTS.finditer(log_text):
        ok, made, mean_len = int(match.group(1)), int(match.group(2)), float(match.group(3))
        drafted += made
        accepted += ok
        drafts += ok / (mean_len - 1) if mean_len > 1 else 0
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}


def measure(
    server: Server,
    base_url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    streams: int,
    log_path: Path | None = None,
) -> dict[str, Any]:
    prefix = {"tokenmill": "tokenmill", "vllm": "vllm"}.get(server.counters)
    before = spec_counters(prefix, metrics(base_url)) if prefix else {}
    log_offset = log_path.stat().st_size if log_path is not None else 0
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: one_request(base_url, model, p, max_tokens), prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    tpots = [
        (r["last"] - r["first"]) / (r["tokens"] - 1)
        for r in results
        if r["first"] is not None and r["tokens"] > 1
    ]
    ttfts = [r["first"] - r["sent"] for r in results if r["first"] is not None]
    drafts = drafted = accepted = None
    if prefix:
        time.sleep(0.5)  # counters are read after the step that finished the last request
        after = spec_counters(prefix, metrics(base_url))
        drafts, drafted, accepted = (after[c] - before[c] for c in SPEC_COUNTERS)
    elif log_path is not None:
        time.sleep(0.5)
        with open(log_path, "rb") as log:
            log.seek(log_offset)
            counts = llamacpp_counters(log.read().decode(errors="replace"))
        if counts["num_draft_tokens"]:
            drafts = counts["num_drafts"]
            drafted, accepted = counts["num_draft_tokens"], counts["num_accepted_tokens"]
        else:  # fall back on the responses' timings (no draft count there)
            timings = [r["timings"] for r in results if r["timings"]]
            if any("draft_n" in t for t in timings):
                drafted = sum(t.get("draft_n", 0) for t in timings)
                accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    return {
        "streams": streams,
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "mean_tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts and accepted is not None else None,
    }


# ------------------------------------------------------------------------------- output


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def fmt(value: Any, digits: int = 1) -> str:
        if value is None:
            return ""
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    head = (
        f"| {args.model}, {args.num_requests} requests x {args.max_tokens} tokens, greedy, "
        f"k={args.num_speculative_tokens}, medians of {args.rounds} rounds | workload | streams | output tok/s | TPOT mean ms | "
        "TTFT mean ms | acceptance | mean accepted length | drafted / accepted |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        name = f"{r['engine']} {r['config']}"
        if "error" in r:
            lines.append(
                f"| {name} | {r.get('workload', '')} | | not run: {r['error']} | | | | | |"
            )
            continue
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else ""
        counts = (
            f"{fmt(r['num_draft_tokens'], 0)} / {fmt(r['num_accepted_tokens'], 0)}"
            if r["num_draft_tokens"] is not None
            else ""
        )
        lines.append(
            f"| {name} | {r['workload']} | {r['streams']} | {fmt(r['output_tok_s'])} | "
            f"{fmt(r['mean_tpot_ms'])} | {fmt(r['mean_ttft_ms'])} | {rate} | "
            f"{fmt(r['mean_accepted_length'], 2)} | {counts} |"
        )
    return head + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo", help="tokenmill's model name (and served name)")
    parser.add_argument("--model-dir", type=Path, default=None, help="HF folder for vLLM")
    parser.add_argument("--draft-model", default="demo-draft")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=["copy", "text"], choices=list(WORKLOADS))
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["tokenmill", "llamacpp", "vllm"],
        choices=["tokenmill", "llamacpp", "vllm"],
    )
    parser.add_argument("--configs", nargs="+", default=["plain", "ngram", "draft"])
    parser.add_argument(
        "--dtype",
        default="float32",
        help="tokenmill's and vLLM's dtype; float32 matches the f32 GGUF and keeps greedy "
        "speculation bitwise identical (bf16 rounds a k + 1-row verification differently "
        "from a decode row, which can flip near-ties)",
    )
    parser.add_argument("--gguf-dir", type=Path, default=PEERS / "gguf")
    parser.add_argument("--gguf-type", default="f32", help="f32 matches tokenmill's float32")
    parser.add_argument("--vllm-python", default=str(PEERS / "vllm-venv" / "bin" / "python"))
    parser.add_argument("--threads", type=int, default=None, help="peers' threads (all cores)")
    parser.add_argument(
        "--tokenmill-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="more flags for tokenmill serve (last on the line)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds over every server, all started at once; rows are the rounds' medians",
    )
    parser.add_argument("--port", type=int, default=18480, help="the first server's; then +1 each")
    parser.add_argument("--out", type=Path, default=Path("results/spec_decode.json"))
    args = parser.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = demo_model_path() if args.model == "demo" else Path(args.model)
    if args.draft_model == "demo-draft":
        args.draft_model = str(demo_draft_path())
    return args


def wanted_workloads(args: argparse.Namespace, server: Server) -> list[str]:
    """n-gram only where prompt lookup has something to find (the copy workloads)."""
    return [w for w in args.workloads if server.label != "ngram" or w.startswith("copy")]


def median_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server, workload, streams): medians of the rounds' speeds, the rounds'
    counters summed (so acceptance is over every round), and each round's TPOT beside."""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for sample in samples:
        key = (sample["engine"], sample["config"], sample["workload"], sample["streams"])
        groups.setdefault(key, []).append(sample)
    rows = []
    for (engine, config, workload, streams), group in groups.items():
        ok = [g for g in group if "error" not in g]
        row: dict[str, Any] = {"engine": engine, "config": config, "workload": workload}
        if not ok:
            rows.append(row | {"streams": streams, "error": group[0]["error"]})
            continue
        row |= {"streams": streams, "rounds": len(ok), "num_requests": ok[0]["num_requests"]}
        row["output_tokens"] = sum(g["output_tokens"] for g in ok)
        for name in ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms"):
            values = [g[name] for g in ok if g[name] is not None]
            row[name] = statistics.median(values) if values else None
        row["tpot_ms_by_round"] = [g["mean_tpot_ms"] for g in ok]
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            values = [g[name] for g in ok if g[name] is not None]
            row[name] = sum(values) if values else None
        drafts, drafted, accepted = (
            row["num_drafts"],
            row["num_draft_tokens"],
            row["num_accepted_tokens"],
        )
        row["acceptance_rate"] = accepted / drafted if drafted and accepted is not None else None
        row["mean_accepted_length"] = (
            1 + accepted / drafts if drafts and accepted is not None else None
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Start every server at once (each on its own port; an idle one costs no CPU), warm
    them, then run ``--rounds`` rounds; in each, every (workload, streams) cell visits the
    servers in an order rotated by one per round, so a noisy minute hits every
    configuration alike. Rows are the rounds' medians."""
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    up: list[tuple[Server, subprocess.Popen[bytes], Path]] = []
    samples: list[dict[str, Any]] = []
    try:
        for index, server in enumerate(servers(args, args.port)):
            server.cmd[server.cmd.index("--port") + 1] = str(args.port + index)
            log_path = args.out.with_name(
                f"{args.out.stem}-{server.engine.replace(' ', '_')}-{server.label}.log"
            )
            process = start(server, log_path)
            if isinstance(process, str):
                rows.append({"engine": server.engine, "config": server.label, "error": process})
                print(json.dumps(rows[-1]), flush=True)
                continue
            measure(
                server, server.base_url, args.model, copy_prompts(2), min(8, args.max_tokens), 2
            )
            up.append((server, process, log_path))
        for round_index in range(args.rounds):
            order = up[round_index % len(up) :] + up[: round_index % len(up)] if up else []
            for workload in args.workloads:
                prompts = WORKLOADS[workload](args.num_requests)
                for streams in args.streams:
                    for server, _, log_path in order:
                        if workload not in wanted_workloads(args, server):
                            continue
                        sample: dict[str, Any] = {
                            "engine": server.engine,
                            "config": server.label,
                            "workload": workload,
                            "streams": streams,
                            "round": round_index,
                        }
                        try:
                            sample |= measure(
                                server,
                                server.base_url,
                                args.model,
                                prompts,
                                args.max_tokens,
                                streams,
                                log_path if server.counters == "llamacpp" else None,
                            )
                        except httpx.HTTPError as exc:
                            sample["error"] = f"{type(exc).__name__}: {exc}"
                        samples.append(sample)
                        print(json.dumps(sample), flush=True)
        rows += median_rows(samples)
    finally:
        for _, process, _ in up:
            stop(process)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out = {"config": config, "rows": rows, "samples": samples}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    table = markdown(rows, args)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
