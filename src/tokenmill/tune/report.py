"""The tune report: ``report.html`` with PNG charts, read from ``result.json``'s data.

Charts: goodput against P95 TTFT, P95 TPOT and memory (the Pareto front marked: no other
candidate has more goodput at lower latency or memory), and each finalist's goodput over
its rounds, so a reader sees which differences are inside the noise.

Each candidate is plotted at its largest replay, and successive halving leaves candidates at
different replay sizes. Goodput is not comparable across them: a 16-request sample of a
300-request chat trace gave ~2.0 req/s where the whole trace gave 1.5 (a short replay ends
soon after its last arrival), so a single front over all points put eliminated candidates on
it. The front is drawn within each replay size, each size with its own marker.
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tokenmill.tune.scoring import GOODPUT_KEY, peak_rss


def _point(entry: dict[str, Any]) -> dict[str, float] | None:
    """Mean figures of a candidate's largest replay (what it was judged on)."""
    runs = {k: v for k, v in (entry.get("runs") or {}).items() if not k.startswith("superseded")}
    if not runs:
        return None
    largest = max(int(k.split("/")[0]) for k in runs)
    figures = [v for k, v in runs.items() if int(k.split("/")[0]) == largest]

    def mean(key: str) -> float:
        values = [float(f[key]) for f in figures if isinstance(f.get(key), (int, float))]
        return statistics.fmean(values) if values else float("nan")

    # what the server held at its peak, as the decision's tie-break compares; the plan (an
    # upper bound: weights plus the KV the trace could ask for) only where none was reported
    memory = peak_rss(figures) or entry.get("memory_bytes") or float("nan")
    return {
        "goodput": mean(GOODPUT_KEY),
        "throughput": mean("request_throughput"),
        "ttft": mean("p95_ttft_ms"),
        "tpot": mean("p95_tpot_ms"),
        "memory_mib": float(memory) / 2**20 if memory == memory else float("nan"),
        "num_requests": float(largest),
    }


def winner_figures(result: dict[str, Any]) -> dict[str, Any] | None:
    """The winner's figures as the ``--compare`` endpoints get theirs: the means over its
    largest replay's rounds (None without a winner, or with nothing measured)."""
    key = (result.get("decision") or {}).get("winner")
    entry = next((e for e in result.get("candidates", []) if e.get("key") == key), None)
    if entry is None:
        return None
    point = _point(entry)
    if point is None:
        return None
    runs = entry.get("runs") or {}
    largest = int(point["num_requests"])
    return {
        "key": key,
        GOODPUT_KEY: point["goodput"],
        "p95_ttft_ms": point["ttft"],
        "p95_tpot_ms": point["tpot"],
        "measured_on_requests": largest,
        "num_rounds": sum(1 for k in runs if k.split("/")[0] == str(largest)),
        "meets_sla": bool((result.get("decision") or {}).get("meets_sla")),
    }


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point dominates (lower cost x, higher goodput y)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 >= y) and (x2, y2) != (x, y) for x2, y2 in points):
            front.append(i)
    return front


def fronts_by_replay(points: list[tuple[float, float, float]]) -> dict[float, list[int]]:
    """For points (replay size, cost x, goodput y): each replay size's Pareto front, as
    indices into ``points``. A point is only compared with points replayed on as many
    requests: goodput depends on the replay's length."""
    fronts: dict[float, list[int]] = {}
    for size in sorted({n for n, _, _ in points}):
        members = [i for i, (n, _, _) in enumerate(points) if n == size]
        front = pareto_front([(points[i][1], points[i][2]) for i in members])
        fronts[size] = [members[j] for j in front]
    return fronts


RUNG_STYLES = (("o", "tab:blue"), ("s", "tab:orange"), ("^", "tab:purple"), ("D", "tab:brown"))
"""Marker and colour per replay size, smallest first (the last repeats beyond four)."""


def _scatter(
    entries: list[tuple[str, dict[str, float], str]],
    key: str,
    label: str,
    path: Path,
    limit: float | None,
) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    points = [(p["num_requests"], p[key], p["goodput"]) for _, p, _ in entries]
    fronts = fronts_by_replay(points)
    on_front = {i for front in fronts.values() for i in front}
    for rung, (size, front) in enumerate(fronts.items()):
        marker, color = RUNG_STYLES[min(rung, len(RUNG_STYLES) - 1)]
        members = [i for i, (n, _, _) in enumerate(points) if n == size]
        ax.scatter(
            [points[i][1] for i in members],
            [points[i][2] for i in members],
            color=color,
            marker=marker,
            s=[60 if i in front else 25 for i in members],
            label=f"{int(size)} requests",
        )
        front_pts = sorted((points[i][1], points[i][2]) for i in front)
        if len(front_pts) > 1:
            ax.plot(*zip(*front_pts, strict=True), color=color, linewidth=1, linestyle="--")
    for i, (name, p, status) in enumerate(entries):
        if status == "winner":
            ax.scatter(p[key], p["goodput"], color="tab:green", marker="*", s=160, zorder=3)
        if i in on_front or status == "winner":
            ax.annotate(name[:40], (p[key], p["goodput"]), fontsize=6)
    ax.legend(fontsize=7, title="largest replay (dashed: its Pareto front)", title_fontsize=7)
    if limit is not None:
        ax.axvline(limit, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel(label)
    ax.set_ylabel("goodput (req/s within the SLA)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spread_chart(finalists: list[tuple[str, list[float]]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.5 * max(1, len(finalists))))
    for i, (_, values) in enumerate(finalists):
        ax.plot([min(values), max(values)], [i, i], color="tab:blue")
        ax.scatter(values, [i] * len(values), color="tab:blue", s=15)
    ax.set_yticks(range(len(finalists)), [n[:40] for n, _ in finalists], fontsize=7)
    ax.set_xlabel("goodput per round (req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_charts(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """The PNG charts for ``result`` (those with data) in ``out_dir``."""
    entries = []
    for e in result.get("candidates", []):
        p = _point(e)
        if p is not None:
            entries.append((e["key"], p, e.get("status", "")))
    sla = result.get("sla") or {}
    charts: dict[str, Path] = {}
    if not entries:
        return charts
    charts["goodput_vs_ttft"] = _scatter(
        entries, "ttft", "P95 TTFT (ms)", out_dir / "goodput_vs_ttft.png", sla.get("p95_ttft_ms")
    )
    charts["goodput_vs_tpot"] = _scatter(
        entries, "tpot", "P95 TPOT (ms)", out_dir / "goodput_vs_tpot.png", sla.get("p95_tpot_ms")
    )
    with_memory = [e for e in entries if e[1]["memory_mib"] == e[1]["memory_mib"]]
    if with_memory:
        charts["goodput_vs_memory"] = _scatter(
            with_memory,
            "memory_mib",
            "memory (MiB: peak RSS, planned where not reported)",
            out_dir / "goodput_vs_memory.png",
            None,
        )
    finalists = []
    for e in result.get("candidates", []):
        runs = e.get("runs") or {}
        full = [
            float(v.get(GOODPUT_KEY) or 0)
            for k, v in runs.items()
            if k.startswith(f"{result.get('num_trace_requests')}/")
        ]
        if len(full) >= 2:
            finalists.append((e["key"], full))
    if finalists:
        charts["finalists_spread"] = _spread_chart(finalists, out_dir / "finalists_spread.png")
    return charts


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        # three significant digits, but no exponent for thousands (a 9,195 ms TTFT, 1,085 MiB)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return _esc(value)


def render_html(
    result: dict[str, Any], charts: dict[str, Path], command: str, config_yaml: str
) -> str:
    """The report page: the decision and why, the command, every candidate, the charts."""
    d = result.get("decision") or {}
    rows = []
    for e in result.get("candidates", []):
        p = _point(e) or {}
        rows.append(
            "<tr>" + "".join(
                f"<td>{x}</td>"
                for x in (
                    _esc(e["key"]) + (" (refined)" if e.get("origin") == "refined" else ""),
                    _esc(e["status"]), _fmt(p.get("num_requests")),
                    _fmt(p.get("goodput")), _fmt(p.get("throughput")), _fmt(p.get("ttft")),
                    _fmt(p.get("tpot")), _fmt(p.get("memory_mib")),
                    _fmt((e.get("gate") or {}).get("top1_agreement")), _esc(e.get("reason")),
                )
            ) + "</tr>"
        )  # fmt: skip
    workload = result.get("workload_summary") or {}
    compare = result.get("compare") or []
    winner = result.get("compare_winner") or (winner_figures(result) if compare else None)
    compared = [
        {**winner, "url": f"winner: {winner['key']} (mean of {winner['num_rounds']} replays)"}
        if winner
        else None,
        *compare,
    ]
    compare_rows = "".join(
        f"<tr><td>{_esc(c.get('url'))}</td><td>{_fmt(c.get('request_goodput'))}</td><td>{_fmt(c.get('p95_ttft_ms'))}</td>"
        f"<td>{_fmt(c.get('p95_tpot_ms'))}</td><td>{_esc('failed: ' + c['error'] if c.get('error') else ('meets' if c.get('meets_sla') else 'misses'))}</td></tr>"
        for c in compared
        if c is not None
    )
    images = "".join(
        f'<h3>{_esc(name)}</h3><img src="{_esc(path.name)}">' for name, path in charts.items()
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>tokenmill tune: {_esc(result.get("model"))}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}td,th{{border:1px solid #ccc;padding:3px;font-size:12px}}table{{border-collapse:collapse}}pre{{background:#f4f4f4;padding:8px}}</style></head><body>
<h1>tokenmill tune: {_esc(result.get("model"))}</h1>
<p>Workload {_esc(workload.get("source"))}: {_esc(workload.get("num_requests"))} requests over {_esc(workload.get("duration_s"))} s
(time scale {_esc(result.get("time_scale"))}); SLA {_esc(result.get("sla"))}; search took {_fmt(result.get("elapsed_s"))} s of a {_fmt(result.get("budget_s"))} s budget{" (stopped by the budget)" if d.get("stopped_by_budget") else ""}.</p>
<h2>Decision</h2>
<p><b>{_esc(d.get("winner"))}</b> {"meets the SLA with room under every bound " + _esc(d.get("sla_room")) if d.get("meets_sla_with_room") else _esc(d.get("reason"))}; goodput per round {_esc(d.get("goodput_rounds"))} on {_esc(d.get("measured_on_requests"))} requests.</p>
<p>{_esc(d.get("tie_note") or "No other candidate was inside its measured spread.")}</p>
{f"<p>Halving: {_esc(result['halving'])}.</p>" if result.get("halving") else ""}
{f"<p>Near ties: {_esc(result['near_ties'])}.</p>" if result.get("near_ties") else ""}
{f"<p>Refinement (candidates added between two measured values): {_esc(result['refinement'])}.</p>" if result.get("refinement") else ""}
<pre>{_esc(command)}</pre><pre>{_esc(config_yaml)}</pre>
<p>Client CPU time is recorded per replay (<code>client_cpu_s</code> in result.json): on a small machine the load generator competes with the server for cores.</p>
<h2>Candidates</h2><table><tr><th>candidate</th><th>status</th><th>largest replay (requests)</th><th>goodput req/s</th><th>served req/s</th><th>P95 TTFT ms</th><th>P95 TPOT ms</th><th>memory MiB (peak RSS)</th><th>top-1 agreement</th><th>why</th></tr>{"".join(rows)}</table>
{f"<h2>Other endpoints, same trace</h2><table><tr><th>endpoint</th><th>goodput req/s</th><th>served req/s</th><th>P95 TTFT ms</th><th>P95 TPOT ms</th><th>SLA</th></tr>{compare_rows}</table>" if compare else ""}
<h2>Charts</h2><p>Each candidate at its largest replay (successive halving stops most on a
sample). Goodput depends on the replay's length, so candidates are compared, and the Pareto
front drawn, only among those replayed on as many requests.</p>{images}
</body></html>
"""


def write_report(result: dict[str, Any], out_dir: Path, command: str, config_yaml: str) -> Path:
    """Charts and ``report.html`` in ``out_dir``; returns the HTML's path."""
    charts = write_charts(result, out_dir)
    path = out_dir / "report.html"
    path.write_text(render_html(result, charts, command, config_yaml), encoding="utf-8")
    return path
