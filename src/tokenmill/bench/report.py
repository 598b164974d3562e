"""The comparison's pictures and page: PNG plots and a self-contained ``report.html``.

Three plots answer the three questions a reader brings: how do latency percentiles
compare (TTFT and TPOT), how does throughput grow with load, and what latency does each
target pay for its throughput. Axes start at zero and error bars span the rounds, so
figures within noise look alike; one load per target is drawn as bars, not a curve. The HTML puts the verdict first, then the side-by-side
table, the SLA outcome and the plots, with images embedded as base64 so the file can be
mailed or attached to an issue on its own. Figures are drawn without pyplot (no global
backend state, safe in threads and on headless machines).
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

from tokenmill.bench import MissingExtraError
from tokenmill.bench.compare import Comparison, describe_load, noise_rule, table_rows
from tokenmill.bench.results import load_of, num_rounds_of, round_values, spread_of

try:
    from matplotlib.figure import Figure
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("matplotlib") from exc

PLOT_FILES: dict[str, str] = {
    "latency_percentiles": "latency_percentiles.png",
    "throughput_vs_load": "throughput_vs_concurrency.png",
    "latency_vs_throughput": "latency_vs_throughput.png",
}
"""PNG file name of each plot in the output folder."""
_PERCENTILE_STATS: tuple[str, ...] = ("median", "p90", "p95", "p99")
_DPI = 110


def _sla_limits(comparison: Comparison, metric: str) -> list[tuple[str, float]]:
    return [
        (key.split("_")[0], limit)
        for key, limit in comparison.sla.items()
        if key.split("_")[1] == metric
    ]


def _headline_load(comparison: Comparison) -> str:
    loads = {
        describe_load(comparison.load_kind, load_of(t.headline)[1]) for t in comparison.targets
    }
    return loads.pop() if len(loads) == 1 else "each target's highest load"


def _yerr(points: list[dict[str, Any]], key: str) -> list[list[float]] | None:
    """Error bars from each point's value down to its rounds' min and up to their max;
    None when every point is a single run."""
    spreads = [spread_of(p, key) for p in points]
    if all(sp is None for sp in spreads):
        return None
    values = [p.get(key) or 0.0 for p in points]
    low = [v - sp[0] if sp else 0.0 for v, sp in zip(values, spreads, strict=True)]
    high = [sp[1] - v if sp else 0.0 for v, sp in zip(values, spreads, strict=True)]
    return [[max(x, 0.0) for x in low], [max(x, 0.0) for x in high]]


def _rounds_note(comparison: Comparison) -> str:
    counts = sorted(
        {len(round_values(t.headline, "output_throughput")) for t in comparison.targets}
    )
    if counts[-1] <= 1:
        return "one round each: no error bars"
    return f"error bars: min-max over {'/'.join(str(max(c, 1)) for c in counts)} rounds"


def plot_latency_percentiles(comparison: Comparison, path: Path) -> Path:
    """Grouped bars of TTFT and TPOT median/p90/p95/p99 per target, SLA limits dashed."""
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    num_targets = len(comparison.targets)
    width = 0.8 / max(num_targets, 1)
    for ax, metric, title in zip(
        axes, ("ttft", "tpot"), ("Time to first token", "Time per output token"), strict=True
    ):
        for i, target in enumerate(comparison.targets):
            keys = [f"{stat}_{metric}_ms" for stat in _PERCENTILE_STATS]
            values = [target.headline.get(key) or 0.0 for key in keys]
            errors = [_yerr([target.headline], key) for key in keys]
            yerr = (
                None
                if all(e is None for e in errors)
                else [
                    [e[0][0] if e else 0.0 for e in errors],
                    [e[1][0] if e else 0.0 for e in errors],
                ]
            )
            xs = [j + (i - (num_targets - 1) / 2) * width for j in range(len(_PERCENTILE_STATS))]
            ax.bar(xs, values, width=width, label=target.name, yerr=yerr, capsize=2)
        for stat, limit in _sla_limits(comparison, metric):
            ax.axhline(limit, linestyle="--", color="crimson", linewidth=1)
            ax.annotate(
                f"SLA {stat} {limit:g} ms",
                (len(_PERCENTILE_STATS) - 0.5, limit),
                color="crimson",
                ha="right",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(_PERCENTILE_STATS)), list(_PERCENTILE_STATS))
        ax.set_ylabel("ms")
        ax.set_title(f"{title} ({_headline_load(comparison)})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_rounds_note(comparison), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def build_throughput_figure(comparison: Comparison) -> Figure:
    """Output tok/s against load, a line per target's sweep; bars when no target has two
    loads to draw a line through. The axis starts at zero, so close figures look close."""
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    is_curve = any(sum(load_of(p)[1] is not None for p in t.points) > 1 for t in comparison.targets)
    if is_curve:
        for target in comparison.targets:
            located = [(p, load_of(p)[1]) for p in target.points]
            points = [p for p, x in located if x is not None]
            xs = [x for _, x in located if x is not None]
            ys = [p.get("output_throughput") or 0.0 for p in points]
            ax.errorbar(
                xs,
                ys,
                yerr=_yerr(points, "output_throughput"),
                marker="o",
                capsize=3,
                label=target.name,
            )
            if target.max_load_within_sla is not None:
                best = max(target.sla_points, key=lambda p: load_of(p)[1] or 0.0)
                ax.scatter(
                    [target.max_load_within_sla],
                    [best.get("output_throughput") or 0.0],
                    s=160,
                    facecolors="none",
                    edgecolors="green",
                    linewidths=2,
                )
        if comparison.load_kind == "concurrency":
            ax.set_xscale("log", base=2)
            loads = sorted(
                {
                    x
                    for t in comparison.targets
                    for p in t.points
                    if (x := load_of(p)[1]) is not None
                }
            )
            ax.set_xticks(loads, [f"{x:g}" for x in loads])
            ax.minorticks_off()
        ax.set_xlabel(
            "max concurrency" if comparison.load_kind == "concurrency" else "request rate (req/s)"
        )
        ax.legend(fontsize=8)
        title = "Output throughput against load"
        if comparison.sla:
            title += " (circled: highest load within SLA)"
    else:
        headlines = [t.headline for t in comparison.targets]
        bars = ax.bar(
            [t.name for t in comparison.targets],
            [h.get("output_throughput") or 0.0 for h in headlines],
            yerr=_yerr(headlines, "output_throughput"),
            capsize=4,
        )
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        title = f"Output throughput at {_headline_load(comparison)} (one load per target: bars, not a curve)"
    ax.set_title(f"{title}\n{_rounds_note(comparison)}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_throughput_vs_load(comparison: Comparison, path: Path) -> Path:
    """``build_throughput_figure`` saved as a PNG."""
    build_throughput_figure(comparison).savefig(path, dpi=_DPI)
    return path


def build_latency_vs_throughput_figure(comparison: Comparison) -> Figure:
    """p95 TTFT and p95 TPOT against output tok/s, one line per target's sweep, axes from
    zero; a title that says so when each target is a single point."""
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    is_single = all(len(t.points) == 1 for t in comparison.targets)
    for ax, metric, title in zip(axes, ("ttft", "tpot"), ("p95 TTFT", "p95 TPOT"), strict=True):
        for target in comparison.targets:
            xs = [p.get("output_throughput") or 0.0 for p in target.points]
            ys = [p.get(f"p95_{metric}_ms") or 0.0 for p in target.points]
            ax.plot(xs, ys, marker="o", label=target.name)
            for point, x, y in zip(target.points, xs, ys, strict=True):
                load = load_of(point)[1]
                if load is not None:
                    ax.annotate(
                        f"{load:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                    )
        for stat, limit in _sla_limits(comparison, metric):
            if stat == "p95":
                ax.axhline(
                    limit, linestyle="--", color="crimson", linewidth=1, label=f"SLA {limit:g} ms"
                )
        all_xs = [p.get("output_throughput") or 0.0 for t in comparison.targets for p in t.points]
        all_ys = [p.get(f"p95_{metric}_ms") or 0.0 for t in comparison.targets for p in t.points]
        ax.set_xlim(
            0, max(all_xs, default=0.0) * 1.12 or 1.0
        )  # room for the last point and its label
        ax.set_ylim(
            0,
            max([*all_ys, *(limit for _, limit in _sla_limits(comparison, metric))], default=0.0)
            * 1.12
            or 1.0,
        )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        detail = "one point per target: no curve to read" if is_single else "labels: load"
        ax.set_title(f"{title} against throughput ({detail})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_latency_vs_throughput(comparison: Comparison, path: Path) -> Path:
    """``build_latency_vs_throughput_figure`` saved as a PNG."""
    build_latency_vs_throughput_figure(comparison).savefig(path, dpi=_DPI)
    return path


def write_plots(comparison: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """Draw every plot into ``out_dir``; returns plot name -> PNG path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "latency_percentiles": plot_latency_percentiles(
            comparison, folder / PLOT_FILES["latency_percentiles"]
        ),
        "throughput_vs_load": plot_throughput_vs_load(
            comparison, folder / PLOT_FILES["throughput_vs_load"]
        ),
        "latency_vs_throughput": plot_latency_vs_throughput(
            comparison, folder / PLOT_FILES["latency_vs_throughput"]
        ),
    }


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222}
.verdict{font-size:1.25em;padding:1em 1.2em;border-left:6px solid #2e7d32;background:#eef7ee;margin:1em 0}
.verdict.none{border-color:#c62828;background:#fbeeee}
.verdict.tie{border-color:#757575;background:#f3f3f3}
.warning{padding:.6em 1.2em;border-left:6px solid #ef6c00;background:#fff4e5;margin:1em 0}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.35em .7em;text-align:right}
th:first-child,td:first-child{text-align:left}
th{background:#f3f3f3}
.better{color:#2e7d32;font-weight:600}.worse{color:#c62828;font-weight:600}
.noise,.spread{color:#777}
.ok{color:#2e7d32;font-weight:600}.miss{color:#c62828;font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.note{color:#666;font-size:.85em}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.2f}" if math.isfinite(value) else str(value)
    return _esc(value)


def _side_by_side_html(comparison: Comparison) -> str:
    names = [t.name for t in comparison.targets]
    head = "".join(
        f"<th>{_esc(n)}{' (baseline)' if n == comparison.baseline else ''}</th>" for n in names
    )
    loads = "".join(
        f"<td>{_esc(describe_load(comparison.load_kind, load_of(t.headline)[1]))}</td>"
        for t in comparison.targets
    )
    rows = [f"<tr><th>Metric</th>{head}</tr>", f"<tr><td>Load</td>{loads}</tr>"]
    rounds = "".join(f"<td>{num_rounds_of(t.headline)}</td>" for t in comparison.targets)
    rows.append(f"<tr><td>Rounds</td>{rounds}</tr>")
    for spec, cells in table_rows(comparison):
        tds = []
        for cell in cells:
            spread_html = ""
            if cell.spread is not None and cell.spread[0] != cell.spread[1]:
                spread_html = f' <span class="spread">[{_fmt(cell.spread[0])}&ndash;{_fmt(cell.spread[1])}]</span>'
            ratio_html = ""
            if cell.ratio is not None:
                is_better = cell.ratio > 1 if spec.is_higher_better else cell.ratio < 1
                if cell.is_clear:
                    ratio_html = f' <span class="{"better" if is_better else "worse"}">({cell.ratio:.2f}x)</span>'
                else:
                    ratio_html = f' <span class="noise">(~{cell.ratio:.2f}x)</span>'
            tds.append(f"<td>{_fmt(cell.value)}{spread_html}{ratio_html}</td>")
        rows.append(f"<tr><td>{_esc(spec.title)}</td>{''.join(tds)}</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _sla_html(comparison: Comparison) -> str:
    if not comparison.sla:
        return '<p class="note">No SLA given (pass <code>--sla ttft_p95_ms=800,tpot_p95_ms=50</code>).</p>'
    terms = ", ".join(f"{_esc(k)} &le; {v:g}" for k, v in comparison.sla.items())
    rows = [
        "<tr><th>Target</th><th>Meets SLA</th><th>Highest load within SLA</th>"
        "<th>Output tok/s there</th><th>First miss</th></tr>"
    ]
    for t in comparison.targets:
        best = t.best_within_sla
        verdict = '<span class="ok">yes</span>' if t.meets_sla else '<span class="miss">no</span>'
        max_load = "-"
        if t.meets_sla:
            max_load = (
                "its measured load"
                if t.max_load_within_sla is None
                else describe_load(comparison.load_kind, t.max_load_within_sla)
            )
        first_miss = next(iter(t.sla_misses.values()), [])
        rows.append(
            f"<tr><td>{_esc(t.name)}</td><td>{verdict}</td>"
            f"<td>{_esc(max_load)}</td>"
            f"<td>{_fmt(best.get('output_throughput')) if best else '-'}</td>"
            f"<td>{_esc('; '.join(first_miss)) or '-'}</td></tr>"
        )
    return f"<p>SLA: {terms}</p><table>{''.join(rows)}</table>"


def _sweep_html(comparison: Comparison) -> str:
    keys = (
        "output_throughput",
        "request_throughput",
        "p95_ttft_ms",
        "p95_tpot_ms",
        "p99_e2el_ms",
        "failed",
    )
    rows = [
        "<tr><th>Target</th><th>Load</th>" + "".join(f"<th>{_esc(k)}</th>" for k in keys) + "</tr>"
    ]
    for t in comparison.targets:
        for p in t.points:
            cells = "".join(f"<td>{_fmt(p.get(k))}</td>" for k in keys)
            rows.append(
                f"<tr><td>{_esc(t.name)}</td>"
                f"<td>{_esc(describe_load(comparison.load_kind, load_of(p)[1]))}</td>{cells}</tr>"
            )
    return "<table>" + "".join(rows) + "</table>"


def _warnings_html(comparison: Comparison) -> str:
    return "".join(f'<div class="warning">Warning: {_esc(w)}</div>' for w in comparison.warnings)


def _workload_html(comparison: Comparison) -> str:
    first = comparison.targets[0].points[0]
    items = {
        "endpoint": first.get("endpoint"),
        "num_prompts": first.get("num_prompts"),
        "ignore_eos": first.get("ignore_eos"),
        **(first.get("workload") or {}),
    }
    parts = [f"{_esc(k)}={_esc(v)}" for k, v in items.items() if v is not None]
    return f'<p class="note">Workload: {", ".join(parts) or "n/a"}</p>'


def render_html(comparison: Comparison, plots: dict[str, Path]) -> str:
    """The whole report page as one string, plots inlined as base64 PNGs."""
    images = []
    for name, path in plots.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        images.append(f'<img alt="{_esc(name)}" src="data:image/png;base64,{data}">')
    if comparison.pick is not None:
        verdict_cls = "verdict"
    else:
        verdict_cls = (
            "verdict none" if comparison.verdict.startswith("No target meets") else "verdict tie"
        )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>tokenmill bench compare</title>'
        f"<style>{_CSS}</style></head><body>"
        "<h1>Which backend for this workload?</h1>"
        f'<div class="{verdict_cls}">{_esc(comparison.verdict)}</div>'
        f"{_warnings_html(comparison)}"
        f"{_workload_html(comparison)}"
        "<h2>Side by side</h2>"
        f'<p class="note">Ratios are against {_esc(comparison.baseline)}: green is better, red worse, only '
        "where the difference exceeds the noise; grey ~ ratios cannot be told from noise "
        f"({_esc(noise_rule([t.headline for t in comparison.targets]))}). [min&ndash;max] over rounds.</p>"
        f"{_side_by_side_html(comparison)}"
        f"<h2>SLA</h2>{_sla_html(comparison)}"
        f"<h2>Every measured point</h2>{_sweep_html(comparison)}"
        f"<h2>Plots</h2>{''.join(images)}"
        '<p class="note">Definitions follow vLLM bench serve: TTFT = time to the first streamed token; '
        "TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between streamed chunks; "
        "percentiles interpolate linearly. Generated by tokenmill bench compare.</p>"
        "</body></html>\n"
    )


def write_report(comparison: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """Write the PNGs and ``report.html`` into ``out_dir``; returns name -> path of each file."""
    folder = Path(out_dir)
    plots = write_plots(comparison, folder)
    html_path = folder / "report.html"
    html_path.write_text(render_html(comparison, plots), encoding="utf-8")
    return {**plots, "html": html_path}
