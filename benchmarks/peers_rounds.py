"""Alternating rounds: the 16-stream and long-prompt targets against vLLM CPU measured so
that the machine's drift falls out of the ratio.

A peers step measures one server, then the next, minutes apart. On a shared VM that is not
enough: in one afternoon the same vLLM server moved 300.9 -> 361.8 tok/s at 16 streams in
35 minutes, and tokenmill's ratio against it flipped from 1.24x to 0.83x with it
(``results/peers-smollm2-amx-order-2026-12-07``). Here every contender is started once, each
on its own port, and kept up; each round runs each workload through all of them back to back
(their order rotated per round), so a ratio is taken between runs seconds apart and the
rounds show how far it spreads. A target is called met only where it holds in every round.

Each round draws its own prompts (``--seed`` = the round): the servers stay up, and with the
same prompts every round vLLM's prefix cache, which keeps freed blocks until its pool runs
out, answered 7 of every 8 blocks of the long prompts from the cache from round 2 on (3x its
first round's throughput), while tokenmill's, which reuses freed blocks before touching new
ones unless ``--prefix-cache-fills-pool``, had evicted them. Within a round every server gets
the same prompts.

A server that is up but not being measured must not take CPU from the one that is: each run
records the CPU seconds the other servers' process trees used meanwhile, and the report gives
the largest share.
"""

from __future__ import annotations

import contextlib
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, bench_serve
from peers_plan import PRECISIONS, Context
from peers_servers import summarize, tokenmill_serve, vllm_serve

DEFAULT_ROUNDS = 4
DEFAULT_WORKLOADS = ("many", "long")


@dataclass(frozen=True)
class Comparison:
    """One target: ``server`` against ``baseline`` in the same round.

    ``throughput`` is the least ratio of output throughputs that meets it (None: the ratio is
    reported, no target); ``ttft`` adds that the server's mean TTFT is at or under the
    baseline's in that round.
    """

    server: str
    baseline: str
    throughput: float | None
    ttft: bool


COMPARISONS = (
    Comparison("tm-bf16", "vllm-bf16", 1.2, True),
    Comparison("ref-bf16", "vllm-bf16", 1.2, True),
    Comparison("tm-int8", "tm-bf16", 1.0, False),
    Comparison("tm-int4", "tm-bf16", 1.0, False),
    Comparison("tm-bf16", "ref-bf16", None, False),
)
"""The issue's targets (bf16 >= 1.2x vLLM CPU with TTFT at or under its own; int8 and int4
>= bf16) and the no-regression ratio against ``--ref``, for whichever servers the run has."""


def contender_command(ctx: Context, name: str, port: int) -> list[str]:
    """The command line of the contender ``name`` (``vllm-bf16``, ``tm-PRECISION`` or
    ``ref-bf16``) on ``port``: the same servers as the one-at-a-time steps."""
    if name == "vllm-bf16":
        return vllm_serve(ctx, ctx.dense, 2048, port=port)
    kind, _, precision = name.partition("-")
    if kind in ("tm", "ref") and precision in PRECISIONS:
        command = tokenmill_serve(port, ctx.dense, PRECISIONS[precision], 2048)
        if kind == "ref":
            if ctx.ref_src is None:
                raise ValueError(f"{name} needs --ref (the older tree to run)")
            command = ["env", f"PYTHONPATH={ctx.ref_src}", *command]
        return command
    known = ["vllm-bf16", *(f"{k}-{p}" for k in ("tm", "ref") for p in PRECISIONS)]
    raise ValueError(f"unknown round server {name!r}; one of {', '.join(known)}")


def tree_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process and its live children, summed."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def round_servers(ctx: Context) -> list[str]:
    """``--round-servers``, or vLLM CPU bf16 and tokenmill bf16 (and ``--ref``'s, if given)."""
    if ctx.args.round_servers:
        return [n.strip() for n in ctx.args.round_servers.split(",") if n.strip()]
    return ["vllm-bf16", "tm-bf16", *(["ref-bf16"] if ctx.ref_src is not None else [])]


def rotated(names: list[str], round_index: int) -> list[str]:
    """The round's order: each contender goes first once every ``len(names)`` rounds."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def step_rounds(ctx: Context) -> dict[str, Any]:
    names = round_servers(ctx)
    workloads = [w.strip() for w in ctx.args.round_workloads.split(",") if w.strip()]
    rounds: int = ctx.args.rounds
    commands = {
        name: contender_command(ctx, name, ctx.args.port + i) for i, name in enumerate(names)
    }
    result: dict[str, Any] = {
        "servers": names,
        "workloads": {w: ctx.workloads[w].describe() for w in workloads},
        "commands": {name: shlex.join(cmd) for name, cmd in commands.items()},
        "runs": [],
    }
    with contextlib.ExitStack() as stack:
        servers: dict[str, Server] = {}
        for i, name in enumerate(names):  # one at a time, so no start competes with another
            log = ctx.out / "logs" / f"{ctx.current}-{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            url = f"http://127.0.0.1:{ctx.args.port + i}"
            server = Server(commands[name], url, log=log, ready_timeout_s=900, poll_rss=True)
            servers[name] = stack.enter_context(server)
            print(f"  {name} ready in {server.ready_s:.0f} s on {url}", flush=True)
        for server in servers.values():
            assert server.rss is not None
            server.rss.mark()
        for r in range(rounds):
            order = rotated(names, r)
            for wl_name in workloads:
                wl = ctx.workloads[wl_name]
                for name in order:
                    others = {n: tree_cpu_s(s.pid) for n, s in servers.items() if n != name}
                    start = time.monotonic()
                    raw = bench_serve(
                        servers[name].base_url,
                        ctx.out / "raw" / f"{ctx.current}-{r}-{name}-{wl_name}.json",
                        num_prompts=wl.num_prompts,
                        concurrency=wl.concurrency,
                        input_len=wl.input_len,
                        output_len=wl.output_len,
                        tokenizer=ctx.dense,
                        num_warmups=2,
                        extra=["--seed", str(r)],
                    )
                    wall = time.monotonic() - start
                    others_cpu = {
                        n: round(tree_cpu_s(servers[n].pid) - before, 2)
                        for n, before in others.items()
                    }
                    result["runs"].append(
                        {
                            "round": r,
                            "seed": r,
                            "workload": wl_name,
                            "server": name,
                            "wall_s": round(wall, 1),
                            "others_cpu_s": others_cpu,
                            **summarize(raw),
                        }
                    )
                    print(
                        f"  round {r + 1}/{rounds} {wl_name:5s} {name:10s} "
                        f"{raw['output_throughput']:7.1f} tok/s  TTFT {raw['mean_ttft_ms']:6.0f} ms"
                        f"  TPOT {raw['mean_tpot_ms']:5.1f} ms  (others' CPU "
                        f"{sum(others_cpu.values()):.1f} s of {wall:.0f} s)",
                        flush=True,
                    )
        result["peak_rss_serving_gib"] = {
            name: round(s.rss.peak_since_mark / 2**30, 3)
            for name, s in servers.items()
            if s.rss is not None
        }
    result["summary"] = summarize_rounds(result["runs"])
    return result


def summarize_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each server's throughput and TTFT over rounds, and each comparison whose
    two servers both ran: the ratio in every round, its median, and in how many rounds the
    target held. Pure, so that its verdicts are tested on recorded figures."""
    by_key = {(run["workload"], run["server"], run["round"]): run for run in runs}
    workloads = list(dict.fromkeys(run["workload"] for run in runs))
    servers = list(dict.fromkeys(run["server"] for run in runs))
    rounds = sorted({run["round"] for run in runs})
    out: dict[str, Any] = {}
    for wl in workloads:
        per_server: dict[str, Any] = {}
        for name in servers:
            tps = [
                by_key[(wl, name, r)]["output_throughput"]
                for r in rounds
                if (wl, name, r) in by_key
            ]
            ttfts = [
                by_key[(wl, name, r)]["mean_ttft_ms"] for r in rounds if (wl, name, r) in by_key
            ]
            if tps:
                median = statistics.median(tps)
                per_server[name] = {
                    "output_throughput": tps,
                    "mean_ttft_ms": ttfts,
                    "median_throughput": median,
                    "median_ttft_ms": statistics.median(ttfts),
                    "spread": (max(tps) - min(tps)) / median if median else None,
                }
        comparisons = []
        for c in COMPARISONS:
            paired = [
                (by_key[(wl, c.server, r)], by_key[(wl, c.baseline, r)])
                for r in rounds
                if (wl, c.server, r) in by_key and (wl, c.baseline, r) in by_key
            ]
            if not paired:
                continue
            ratios = [
                ours["output_throughput"] / theirs["output_throughput"] for ours, theirs in paired
            ]
            ttft_ratios = [theirs["mean_ttft_ms"] / ours["mean_ttft_ms"] for ours, theirs in paired]
            entry: dict[str, Any] = {
                "server": c.server,
                "baseline": c.baseline,
                "target": c.throughput,
                "ttft_target": c.ttft,
                "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                "ttft_ratios": ttft_ratios,
                "median_ttft_ratio": statistics.median(ttft_ratios),
            }
            if c.throughput is not None:
                met = [
                    ratio >= c.throughput and (not c.ttft or ttft_ratio >= 1.0)
                    for ratio, ttft_ratio in zip(ratios, ttft_ratios, strict=True)
                ]
                entry["rounds_met"] = sum(met)
                entry["verdict"] = verdict(sum(met), len(met))
            comparisons.append(entry)
        out[wl] = {"servers": per_server, "comparisons": comparisons}
    return out


def verdict(met: int, rounds: int) -> str:
    """``met`` only in every round, ``missed`` in none; anything between is ``split``, which
    says the machine's swing is larger than the difference and the rounds cannot call it."""
    if met == rounds:
        return "met"
    if met == 0:
        return "missed"
    return f"split ({met} of {rounds})"


def render_rounds(
    data: dict[str, Any] | None, verified: dict[str, dict[str, Any]] | None = None
) -> list[str]:
    """The report's section for a rounds step (empty where the run has none); ``verified``:
    v-verify's figures per precision, shown beside tokenmill's servers."""
    if not data or "summary" not in data:
        return []
    summary = data["summary"]
    rounds = 1 + max(run["round"] for run in data["runs"])
    lines = [
        "",
        f"**Alternating rounds** (`a-rounds`: {', '.join(data['servers'])} up at once, each "
        f"on its own port; {rounds} rounds, each running every workload through all of them "
        "back to back in an order rotated per round, with its own prompts (`--seed` = the "
        "round). Ratios are taken within a round; a "
        "target is met only where it holds in every round. "
        + "; ".join(f"{wl} = {text}" for wl, text in data["workloads"].items())
        + "):",
        "",
        "| workload | server | tok/s per round | median tok/s | spread | TTFT mean ms per round "
        "| peak RSS GiB | verify |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rss = data.get("peak_rss_serving_gib", {})
    for wl, entry in summary.items():
        for name, s in entry["servers"].items():
            ver = (verified or {}).get(name.partition("-")[2]) if name.startswith("tm-") else None
            check = f"{ver['top1_agreement']:.1%} / {ver['mean_kl']:.4f}" if ver else ""
            lines.append(
                f"| {wl} | {name} | {' / '.join(f'{v:.1f}' for v in s['output_throughput'])} "
                f"| {s['median_throughput']:.1f} | {100 * (s['spread'] or 0):.0f}% "
                f"| {' / '.join(f'{v:.0f}' for v in s['mean_ttft_ms'])} | {rss.get(name, '—')} "
                f"| {check} |"
            )
    lines += [
        "",
        "| workload | comparison | tok/s ratio per round | median | TTFT ratio per round "
        "(> 1 = lower) | target | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for wl, entry in summary.items():
        for c in entry["comparisons"]:
            target = "—"
            if c["target"] is not None:
                target = f"≥ {c['target']:.1f}x" + (", TTFT ≤" if c["ttft_target"] else "")
            lines.append(
                f"| {wl} | {c['server']} / {c['baseline']} "
                f"| {' / '.join(f'{v:.2f}' for v in c['ratios'])} | **{c['median_ratio']:.2f}x** "
                f"| {' / '.join(f'{v:.2f}' for v in c['ttft_ratios'])} | {target} "
                f"| {c.get('verdict', '—')} |"
            )
    worst = max(
        (
            sum(run["others_cpu_s"].values()) / run["wall_s"]
            for run in data["runs"]
            if run.get("wall_s")
        ),
        default=0.0,
    )
    lines += [
        "",
        f"Idle servers' CPU while another was measured: at most {100 * worst:.1f}% of one "
        "core over a run.",
    ]
    return lines
