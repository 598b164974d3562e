"""The markdown report of a peers run: tables with side-by-side ratios, the commands,
the machine (CPU model and flags, torch, vLLM, llama.cpp) and the steps' times, read from the
step JSON files under the run's ``--out-dir``.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_plan import PRECISIONS, THREADS, Context, Step, git, load
from peers_rounds import render_rounds


def metric(data: dict[str, Any] | None, run: str, key: str) -> float | None:
    if not data or "error" in data:
        return None
    value = data.get("runs", {}).get(run, {}).get(key)
    return float(value) if value is not None else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def render_report(ctx: Context, steps: list[Step]) -> str:
    """The report of the run in ``ctx.out``; ``steps`` are the runner's, in order."""
    wl = ctx.workloads
    n = wl["many"].concurrency
    prep = load(ctx, "prepare") or {}
    missing = "not recorded (no prepare step in this folder)"
    kernels_loaded = (prep.get("kernels") or {}).get("loaded")
    lines = [
        f"Run of `benchmarks/peers_run.py` in {ctx.out} — report written "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"**Machine**: {cpu_model()}, {THREADS} logical CPUs, flags `{' '.join(cpu_flags())}`; "
        f"torch {torch_version()}, vLLM {prep.get('vllm_version', missing)}, llama.cpp "
        f"{' '.join(prep.get('llama_cpp_version', [missing]))}; report written at tokenmill {git('rev-parse', '--short', 'HEAD')}"
        f"; tokenmill kernels loaded: {missing if kernels_loaded is None else kernels_loaded}.",
        "",
        "**Steps** (start → end UTC, wall s):",
        "",
    ]
    for step in steps:
        data = load(ctx, step.name)
        if data is None:
            lines.append(f"- {step.name}: not run")
        else:
            status = f"FAILED: {data['error']}" if "error" in data else "ok"
            at = f", tokenmill at {data['_commit']}" if "_commit" in data else ""
            lines.append(
                f"- {step.name}: {data.get('_started', '?')} → {data.get('_ended', '?')}, "
                f"{data.get('_wall_s', '?')} s{at}, {status}"
            )
    walls = [d["_wall_s"] for st in steps if (d := load(ctx, st.name)) and "_wall_s" in d]
    lines.append(f"- steps' wall time in all: {sum(walls) / 60:.1f} min")
    model = f"`{ctx.dense.name}`" if getattr(ctx.args, "model", None) else "The 250M Llama"
    lines += ["", f"### {model}, every server on the same cores", ""]
    lines.append(
        f"single = {wl['single'].describe()}, many = {wl['many'].describe()}, long = "
        f"{wl['long'].describe()}; greedy, EOS ignored, `tokenmill bench serve` (2 warm-up "
        "requests each). Means over requests. Peak RSS: the server's process tree, while serving."
    )
    verified = (load(ctx, "v-verify") or {}).get("precisions", {})
    lines.append(
        "verify: `tokenmill verify` at the row's precision (v-verify: 8 prompts x 64 greedy "
        "tokens, top-1 agreement / mean KL teacher-forced against float32 transformers; pass "
        "mark 90%); not measured for the peers."
    )
    lines += [
        "",
        f"| server, precision | {n} streams tok/s | {n}-stream TTFT mean ms | 1-stream TPOT ms "
        "| long tok/s | long TTFT mean ms | long TPOT ms | peak RSS GiB | verify |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [
        ("vLLM CPU bf16", "a-vllm-bf16"),
        ("tokenmill bf16 (paged)", "a-tm-bf16"),
        ("tokenmill bf16 static", "a-tm-bf16-static"),
        ("tokenmill bf16, --max-num-seqs 4", "a-tm-bf16-lat"),
        ("tokenmill bf16 static, --max-num-seqs 4", "a-tm-bf16-static-lat"),
        ("tokenmill bf16, --compile-batch-sizes 1", "a-tm-bf16-compiled"),
        ("llama.cpp f16", "a-llama-f16"),
        ("tokenmill fp32", "a-tm-fp32"),
        ("tokenmill int8 (dtype auto)", "a-tm-int8"),
        ("tokenmill int8, --compile-batch-sizes 1", "a-tm-int8-compiled"),
        ("llama.cpp Q8_0", "a-llama-q8_0"),
        ("tokenmill int4 (dtype auto)", "a-tm-int4"),
        ("tokenmill int4, --compile-batch-sizes 1", "a-tm-int4-compiled"),
        ("llama.cpp Q4_0", "a-llama-q4_0"),
        (f"tokenmill bf16 at {(load(ctx, 'a-ref-bf16') or {}).get('ref')}", "a-ref-bf16"),
    ]
    for label, name in rows:
        d = load(ctx, name)
        if d is None:
            continue  # not run (a run of some steps only, or an optional row)
        if d is not None and "error" in d:
            lines.append(f"| {label} | failed: {d['error'][:80]} | | | | | | | |")
            continue
        precision = next((p for p in PRECISIONS if f"tokenmill {p}" in label), "")
        v = verified.get(precision) if name.startswith("a-tm-") and d is not None else None
        check = f"{v['top1_agreement']:.1%} / {v['mean_kl']:.4f}" if v else ""
        lines.append(
            f"| {label} | {fmt(metric(d, 'many', 'output_throughput'))} "
            f"| {fmt(metric(d, 'many', 'mean_ttft_ms'), 0)} "
            f"| {fmt(metric(d, 'single', 'mean_tpot_ms'))} "
            f"| {fmt(metric(d, 'long', 'output_throughput'))} "
            f"| {fmt(metric(d, 'long', 'mean_ttft_ms'), 0)} "
            f"| {fmt(metric(d, 'long', 'mean_tpot_ms'))} "
            f"| {fmt((d or {}).get('peak_rss_serving_gib'), 2)} | {check} |"
        )
    if lines[-1].startswith("|---"):  # no one-at-a-time server step in this run
        lines[-2:] = ["(No one-server-at-a-time step in this run.)"]
    vllm, bf16 = load(ctx, "a-vllm-bf16"), load(ctx, "a-tm-bf16")
    static = load(ctx, "a-tm-bf16-static")
    lat, static_lat = load(ctx, "a-tm-bf16-lat"), load(ctx, "a-tm-bf16-static-lat")
    int8, int4 = load(ctx, "a-tm-int8"), load(ctx, "a-tm-int4")
    compiled = {p: load(ctx, f"a-tm-{p}-compiled") for p in ("bf16", "int8", "int4")}
    f16, q8, q4 = load(ctx, "a-llama-f16"), load(ctx, "a-llama-q8_0"), load(ctx, "a-llama-q4_0")

    def m(d: dict[str, Any] | None, run: str, key: str) -> float | None:
        return metric(d, run, key)

    def inv(a: float | None, b: float | None) -> str:  # lower is better: b / a
        return ratio(b, a)

    lines += [
        "",
        "**Targets, side by side** (ratios > 1.00x favour tokenmill):",
        "",
        "| target | tokenmill | peer | ratio |",
        "|---|---|---|---|",
        f"| {n} streams bf16 tok/s ≥ 1.2x vLLM | {fmt(m(bf16, 'many', 'output_throughput'))} "
        f"| {fmt(m(vllm, 'many', 'output_throughput'))} "
        f"| {ratio(m(bf16, 'many', 'output_throughput'), m(vllm, 'many', 'output_throughput'))} |",
        f"| {n}-stream TTFT mean ≤ vLLM's (ms) | {fmt(m(bf16, 'many', 'mean_ttft_ms'), 0)} "
        f"| {fmt(m(vllm, 'many', 'mean_ttft_ms'), 0)} "
        f"| {inv(m(bf16, 'many', 'mean_ttft_ms'), m(vllm, 'many', 'mean_ttft_ms'))} |",
        f"| long tok/s ≥ 1.2x vLLM | {fmt(m(bf16, 'long', 'output_throughput'))} "
        f"| {fmt(m(vllm, 'long', 'output_throughput'))} "
        f"| {ratio(m(bf16, 'long', 'output_throughput'), m(vllm, 'long', 'output_throughput'))} |",
        f"| long TTFT ≤ vLLM's (ms) | {fmt(m(bf16, 'long', 'mean_ttft_ms'), 0)} "
        f"| {fmt(m(vllm, 'long', 'mean_ttft_ms'), 0)} "
        f"| {inv(m(bf16, 'long', 'mean_ttft_ms'), m(vllm, 'long', 'mean_ttft_ms'))} |",
        f"| long TPOT ≤ vLLM's (ms) | {fmt(m(bf16, 'long', 'mean_tpot_ms'))} "
        f"| {fmt(m(vllm, 'long', 'mean_tpot_ms'))} "
        f"| {inv(m(bf16, 'long', 'mean_tpot_ms'), m(vllm, 'long', 'mean_tpot_ms'))} |",
    ]
    for label, ours, theirs in (
        ("bf16 vs llama.cpp f16", bf16, f16),
        ("bf16 --max-num-seqs 4 vs llama.cpp f16", lat, f16),
        ("bf16 static --max-num-seqs 4 vs llama.cpp f16", static_lat, f16),
        ("bf16 --compile-batch-sizes 1 vs llama.cpp f16", compiled["bf16"], f16),
        ("int8 vs llama.cpp Q8_0", int8, q8),
        ("int8 --compile-batch-sizes 1 vs llama.cpp Q8_0", compiled["int8"], q8),
        ("int4 vs llama.cpp Q4_0", int4, q4),
        ("int4 --compile-batch-sizes 1 vs llama.cpp Q4_0", compiled["int4"], q4),
    ):
        a, b = m(ours, "single", "mean_tpot_ms"), m(theirs, "single", "mean_tpot_ms")
        lines.append(
            f"| 1-stream TPOT ≤ llama.cpp, {label} (ms) | {fmt(a)} | {fmt(b)} | {inv(a, b)} |"
        )
    for label, ours in (("int8", int8), ("int4", int4)):
        a, b = m(ours, "many", "output_throughput"), m(bf16, "many", "output_throughput")
        lines.append(
            f"| {n} streams {label} ≥ bf16 (tok/s) | {fmt(a)} | {fmt(b)} (bf16) | {ratio(a, b)} |"
        )
    a, b = m(static, "single", "mean_tpot_ms"), m(bf16, "single", "mean_tpot_ms")
    lines.append(
        f"| 1-stream TPOT static vs paged (ms) | {fmt(a)} | {fmt(b)} (paged) | {inv(a, b)} |"
    )
    header = lines.index("| target | tokenmill | peer | ratio |")
    measured = [line for line in lines[header + 2 :] if not line.endswith("| — |")]
    if measured:  # rows with a ratio only: a run of some steps leaves the others out
        lines[header + 2 :] = measured
    else:
        del lines[header - 2 :]

    pairs = load(ctx, "a-pairs")
    if pairs is not None and "rounds" in pairs:
        lines += [
            "",
            "**One stream, interleaved** (`a-pairs`: per round, tokenmill then llama.cpp at the "
            "same precision, one server at a time; TPOT mean ms, ratio llama.cpp / tokenmill, "
            "> 1.00x favours tokenmill):",
            "",
            "| precision | "
            + " | ".join(f"round {i + 1}" for i in range(len(pairs["rounds"])))
            + " | median ratio |",
            "|---|" + "---|" * (len(pairs["rounds"]) + 1),
        ]
        for name in pairs["rounds"][0]:
            cells, ratios = [], []
            for row in pairs["rounds"]:
                ours, theirs = row[name]["tokenmill_tpot_ms"], row[name]["llama_tpot_ms"]
                ratios.append(theirs / ours)
                cells.append(f"{ours:.1f} / {theirs:.1f} ({theirs / ours:.2f}x)")
            quant = pairs["rounds"][0][name]["llama_quant"]
            lines.append(
                f"| {name} vs {quant} | "
                + " | ".join(cells)
                + f" | **{statistics.median(ratios):.2f}x** |"
            )

    lines += render_rounds(load(ctx, "a-rounds"), verified)

    ref = load(ctx, "a-ref-bf16")
    lines += ["", "### Fallback and mixture of experts", ""]
    if ref is not None:
        lines += [
            f"**No regression on the dense 250M** (same run: tokenmill bf16 paged at HEAD against "
            f"the same server from a worktree of `{ref.get('ref')}` = {ref.get('ref_commit', '?')[:10]}):",
            "",
            "| workload | HEAD tok/s | ref tok/s | HEAD / ref | HEAD TPOT ms | ref TPOT ms |",
            "|---|---|---|---|---|---|",
        ]
        for run in ("single", "many", "long"):
            a, b = m(bf16, run, "output_throughput"), m(ref, run, "output_throughput")
            lines.append(
                f"| {run} | {fmt(a)} | {fmt(b)} | {ratio(a, b)} | "
                f"{fmt(m(bf16, run, 'mean_tpot_ms'))} | {fmt(m(ref, run, 'mean_tpot_ms'))} |"
            )
    else:
        lines.append(
            "**No regression on the dense 250M**: no `--ref` step in this run; compare the "
            "tokenmill bf16 row above with an earlier run's (across runs, not the same run)."
        )
    fb = load(ctx, "b-fallback")
    lines += [
        "",
        "**The Transformers fallback** (bf16, `--model-impl transformers`, against native in the "
        "same run):",
        "",
        "| workload | native tok/s | fallback tok/s | fallback / native | native TPOT ms | fallback TPOT ms |",
        "|---|---|---|---|---|---|",
    ]
    if fb is not None and "error" in fb:
        lines.append(f"| failed: {fb['error'][:100]} | | | | | |")
    for run in ("single", "many"):
        a, b = m(bf16, run, "output_throughput"), m(fb, run, "output_throughput")
        lines.append(
            f"| {wl[run].describe()} | {fmt(a)} | {fmt(b)} | {ratio(b, a)} | "
            f"{fmt(m(bf16, run, 'mean_tpot_ms'))} | {fmt(m(fb, run, 'mean_tpot_ms'))} |"
        )
    off = load(ctx, "b-moe-offline") or {}
    moe_tm, moe_vllm = load(ctx, "b-moe-tm"), load(ctx, "b-moe-vllm")
    lines += [
        "",
        f"**Mixture of experts** ({ctx.moe.name}: random Mixtral, 8 experts, top-2; bf16). "
        f"Served: moe1 = {wl['moe1'].describe()}, moe16 = {wl['moe16'].describe()}. Offline "
        "(`moe.py`, one process, all prompts submitted at once; Transformers `generate` on one "
        "padded batch): the share of tokenmill's wall time in routing and expert dispatch is "
        "timed around `SparseMoE.route`/`dispatch` inside the engine's steps.",
        "",
        "| streams | tokenmill served tok/s | vLLM CPU served tok/s | tokenmill / vLLM "
        "| tokenmill offline tok/s | Transformers tok/s | tokenmill / Transformers "
        "| routing share | dispatch share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for served_run, index in (("moe1", 0), ("moe16", 1)):
        tm_rows = off.get("tokenmill") or []
        hf_rows = off.get("transformers") or []
        t = tm_rows[index] if index < len(tm_rows) else {}
        h = hf_rows[index] if index < len(hf_rows) else {}
        a, b = (
            m(moe_tm, served_run, "output_throughput"),
            m(moe_vllm, served_run, "output_throughput"),
        )
        share = t.get("route_share"), t.get("dispatch_share")
        lines.append(
            f"| {ctx.workloads[served_run].concurrency} | {fmt(a)} | {fmt(b)} | {ratio(a, b)} "
            f"| {fmt(t.get('output_tok_s'))} | {fmt(h.get('output_tok_s'))} "
            f"| {ratio(t.get('output_tok_s'), h.get('output_tok_s'))} "
            f"| {fmt(None if share[0] is None else 100 * share[0])}% "
            f"| {fmt(None if share[1] is None else 100 * share[1])}% |"
        )
    for name in ("b-moe-vllm", "b-moe-tm", "b-moe-offline"):
        d = load(ctx, name)
        if d is not None and "error" in d:
            lines.append(f"\n{name} failed: `{d['error']}`\n\n```\n{d.get('log_tail', '')}\n```")
    lines += [
        "",
        "**Commands** (this script's invocations, then each server as run):",
        "",
        "```bash",
    ]
    invocations = ctx.out / "invocations.txt"
    if invocations.is_file():
        lines += [f"# {line}" for line in invocations.read_text().splitlines()]
    for step in steps:
        d = load(ctx, step.name)
        if d and d.get("command"):
            lines.append(f"# {step.name}")
            lines.append(d["command"])
            if d.get("long_command"):
                lines.append(d["long_command"])
        for server, command in ((d or {}).get("commands") or {}).items():  # a-rounds
            lines += [f"# {step.name}: {server}", command]
    lines += ["```", ""]
    return "\n".join(lines)


def cpu_flags() -> list[str]:
    wanted = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}
    return sorted(wanted & set(Path("/proc/cpuinfo").read_text().split()))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def torch_version() -> str:
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()
