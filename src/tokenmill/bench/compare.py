"""``tokenmill bench compare``: turn several benchmark results into a decision.

Owns loading result files (tokenmill's and vLLM's ``bench serve`` JSON), naming targets
by what differs between their configs, grouping them into one load sweep per target,
checking each point against an SLA, computing ratios against a baseline, and wording the
verdict: which target to pick for this workload and the highest load each one sustains
within the SLA. A difference is only called when it exceeds the noise: with two or more
rounds per target (``--num-rounds``), when their ranges over rounds do not overlap; with
one round, when one figure is at least ``SINGLE_RUN_NOISE`` above the other. Anything
less is a tie, and the report says so. Reading result files lives in ``results.py``, the
SLA terms in ``sla.py``, drawing and HTML in ``report.py``; this module stays free of
matplotlib.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from tokenmill.bench.results import (
    add_derived_figures,
    load_of,
    num_rounds_of,
    round_values,
    spread_of,
    value_text,
)
from tokenmill.bench.sla import check_sla


@dataclass(frozen=True)
class MetricSpec:
    """A figure the comparison table shows."""

    key: str
    """Key in the result dict."""
    title: str
    """Row label."""
    is_higher_better: bool
    """Direction of 'better', for ratios and colours."""


TABLE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("output_throughput", "Output tok/s", True),
    MetricSpec("request_throughput", "Requests/s", True),
    MetricSpec("request_goodput", "Goodput req/s", True),
    MetricSpec("total_token_throughput", "Total tok/s", True),
    MetricSpec("max_output_tokens_per_s", "Peak output tok/s", True),
    MetricSpec("median_ttft_ms", "TTFT median ms", False),
    MetricSpec("p95_ttft_ms", "TTFT p95 ms", False),
    MetricSpec("p99_ttft_ms", "TTFT p99 ms", False),
    MetricSpec("median_tpot_ms", "TPOT median ms", False),
    MetricSpec("p95_tpot_ms", "TPOT p95 ms", False),
    MetricSpec("p99_tpot_ms", "TPOT p99 ms", False),
    MetricSpec("p95_itl_ms", "ITL p95 ms", False),
    MetricSpec("p95_e2el_ms", "E2E p95 ms", False),
    MetricSpec("failed", "Failed requests", False),
    MetricSpec("peak_memory_gib", "Peak memory GiB", False),
    MetricSpec("peak_kv_cache_usage_perc", "Peak KV cache %", False),
    MetricSpec("num_preemptions", "Preemptions", False),
)
"""Rows of the side-by-side table, in order."""

SINGLE_RUN_NOISE = 0.10
"""Smallest relative difference called from one round per target (one figure at least
1.10x the other). Single runs of one workload on a shared machine move by several percent
from run to run (3-6% was seen between identical configs), so less than 10% is a tie
unless ``--num-rounds`` measures the spread."""


def is_clear_difference(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    """Whether ``a`` and ``b`` differ on ``key`` by more than the noise.

    With two or more rounds each: their ranges over rounds do not overlap. Otherwise:
    the larger value is at least ``1 + SINGLE_RUN_NOISE`` times the smaller.
    """
    va, vb = round_values(a, key), round_values(b, key)
    if not va or not vb:
        return False
    if len(va) > 1 and len(vb) > 1:
        return max(va) < min(vb) or max(vb) < min(va)
    low, high = sorted((float(a[key]), float(b[key])))
    return high > low and high >= low * (1 + SINGLE_RUN_NOISE)


def noise_rule(points: list[dict[str, Any]]) -> str:
    """How ``is_clear_difference`` judged these points, in words for the report."""
    counts = {max(len(round_values(p, "output_throughput")), 1) for p in points}
    if min(counts) > 1:
        return f"their ranges over {'/'.join(str(c) for c in sorted(counts))} rounds overlap"
    return (
        f"from one round, a difference under {SINGLE_RUN_NOISE:.0%} cannot be told from noise; "
        "measure the spread with --num-rounds 3"
    )


@dataclass
class TargetSummary:
    """One target's sweep and its verdict against the SLA."""

    name: str
    points: list[dict[str, Any]]
    """Results sorted by load."""
    headline: dict[str, Any]
    """The point the side-by-side table shows."""
    sla_points: list[dict[str, Any]] = field(default_factory=list)
    """Points that meet the SLA."""
    sla_misses: dict[int, list[str]] = field(default_factory=dict)
    """For each point index, why it misses the SLA."""

    @property
    def meets_sla(self) -> bool:
        return bool(self.sla_points)

    @property
    def best_within_sla(self) -> dict[str, Any] | None:
        """The SLA-meeting point with the highest output throughput."""
        if not self.sla_points:
            return None
        return max(self.sla_points, key=lambda p: p.get("output_throughput") or 0.0)

    @property
    def max_load_within_sla(self) -> float | None:
        """The highest load at which the SLA still held."""
        loads = [x for x in (load_of(p)[1] for p in self.sla_points) if x is not None]
        return max(loads) if loads else None


@dataclass
class Comparison:
    """Everything the table, the plots and the HTML report show."""

    targets: list[TargetSummary]
    baseline: str
    sla: dict[str, float]
    load_kind: str
    verdict: str
    """One or two sentences: which target to pick and why, or that it is a tie."""
    pick: str | None = None
    """The recommended target; None for a tie, a trade-off, or no target within the SLA."""
    warnings: list[str] = field(default_factory=list)
    """Why the figures may not be comparable (e.g. targets ran different workloads)."""

    def target(self, name: str) -> TargetSummary:
        return next(t for t in self.targets if t.name == name)


def _sort_key(result: dict[str, Any]) -> float:
    load = load_of(result)[1]
    return math.inf if load is None else load


def _headline_points(groups: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target's point at the highest load all targets share, else its highest load."""
    load_sets = [{load_of(p)[1] for p in points} for points in groups.values()]
    common = set.intersection(*load_sets) if load_sets else set()
    if common:
        chosen = max(common, key=lambda x: math.inf if x is None else x)
        return {
            name: next(p for p in pts if load_of(p)[1] == chosen) for name, pts in groups.items()
        }
    return {name: pts[-1] for name, pts in groups.items()}


def describe_load(kind: str, load: float | None) -> str:
    """Human words for a load level, e.g. ``concurrency 16`` or ``4 req/s``."""
    if load is None:
        return "unbounded load"
    if kind == "concurrency":
        return f"concurrency {load:g}"
    return f"{load:g} req/s"


def _within_sla_text(kind: str, load: float | None) -> str:
    return f"up to {describe_load(kind, load)}" if load is not None else "at its measured load"


def _ratio_text(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "n/a"


def _leader(
    targets: list[TargetSummary], key: str, is_higher_better: bool, point_of: Any
) -> tuple[TargetSummary | None, list[TargetSummary]]:
    """The target with the best ``key`` at ``point_of(target)``, and the others within noise of it."""
    valued = [t for t in targets if (point_of(t) or {}).get(key) is not None]
    if not valued:
        return None, []
    pick = max if is_higher_better else min
    best = pick(valued, key=lambda t: point_of(t)[key])
    tied = [
        t
        for t in valued
        if t is not best and not is_clear_difference(point_of(t), point_of(best), key)
    ]
    return best, tied


def _tie_text(tied: list[TargetSummary], point_of: Any) -> str:
    """``a 2758.0, b 2744.0 tok/s (why that is within noise)`` for output throughput."""
    figures = ", ".join(f"{t.name} {point_of(t)['output_throughput']:.1f}" for t in tied)
    return f"{figures} tok/s ({noise_rule([point_of(t) for t in tied])})"


def _sla_verdict(
    targets: list[TargetSummary], base: TargetSummary, load_kind: str
) -> tuple[str, str | None]:
    passing = [t for t in targets if t.meets_sla]
    if not passing:
        return "No target meets the SLA at any measured load; relax the SLA or add capacity.", None
    best_point = attrgetter("best_within_sla")
    best, tied = _leader(passing, "output_throughput", True, best_point)
    failing = [t.name for t in targets if not t.meets_sla]
    never = f". Never within the SLA: {', '.join(failing)}" if failing else ""
    if best is None:
        return "No target within the SLA reports output throughput; nothing to decide on.", None
    if tied:
        names = ", ".join(t.name for t in [best, *tied])
        return (
            f"{names} meet the SLA, and their best output throughput within it is a tie: "
            f"{_tie_text([best, *tied], best_point)}; choose on other grounds{never}."
        ), None
    point = best.best_within_sla or {}
    text = (
        f"Pick {best.name}: it meets the SLA {_within_sla_text(load_kind, best.max_load_within_sla)} "
        f"with {point.get('output_throughput', 0.0):.1f} output tok/s"
    )
    base_point = base.best_within_sla
    if best is not base and base_point and base_point.get("output_throughput"):
        text += f", {_ratio_text(point['output_throughput'], base_point['output_throughput'])} {base.name}'s best within SLA"
    elif best is not base:
        text += f"; {base.name} never meets it"
    return text + never + ".", best.name


def _verdict(
    targets: list[TargetSummary], baseline: str, sla: dict[str, float], load_kind: str
) -> tuple[str, str | None]:
    """The verdict sentence and the picked target (None when nothing is clearly better)."""
    base = next(t for t in targets if t.name == baseline)
    if sla:
        return _sla_verdict(targets, base, load_kind)
    headline = attrgetter("headline")
    fastest, tp_tied = _leader(targets, "output_throughput", True, headline)
    quickest, ttft_tied = _leader(targets, "p95_ttft_ms", False, headline)
    if fastest is None:
        return "No target reports output throughput; nothing to decide on.", None
    if tp_tied:
        text = f"Output throughput is a tie: {_tie_text([fastest, *tp_tied], headline)}."
        if quickest is not None and not ttft_tied:
            return (
                f"{text} Lowest p95 TTFT, by more than the noise: {quickest.name} "
                f"({quickest.headline['p95_ttft_ms']:.1f} ms), so pick {quickest.name}."
            ), quickest.name
        return f"{text} No target is clearly better on this workload.", None
    text = f"Highest throughput: {fastest.name} ({fastest.headline.get('output_throughput', 0.0):.1f} output tok/s"
    if fastest is not base and base.headline.get("output_throughput"):
        text += f", {_ratio_text(fastest.headline['output_throughput'], base.headline['output_throughput'])} {base.name}"
    text += ")."
    if quickest is None or quickest is fastest or fastest in ttft_tied:
        also = (
            "also has the lowest p95 TTFT"
            if quickest is fastest
            else "has a p95 TTFT within noise of the lowest"
        )
        return f"{text} It {also}, so pick {fastest.name}.", fastest.name
    return text + (
        f" Lowest p95 TTFT: {quickest.name} ({quickest.headline.get('p95_ttft_ms', 0.0):.1f} ms); "
        "pass --sla to decide between throughput and latency."
    ), None


def workload_warnings(named_results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Why the results may not be comparable: targets that ran different workloads.

    Each result's ``workload`` dict (dataset, lengths, seed...) is compared; a result
    without one (e.g. a vLLM file) cannot be checked, which is said too.
    """
    workloads: dict[str, list[dict[str, Any]]] = {}
    unrecorded: list[str] = []
    for name, result in named_results:
        workload = result.get("workload")
        if not workload:
            if name not in unrecorded:
                unrecorded.append(name)
        elif workload not in workloads.setdefault(name, []):
            workloads[name].append(workload)
    distinct: list[dict[str, Any]] = []
    for target_workloads in workloads.values():
        distinct += [w for w in target_workloads if w not in distinct]
    warnings = []
    if len(distinct) > 1:
        keys = sorted({k for w in distinct for k in w})
        differing = [k for k in keys if len({value_text(w.get(k)) for w in distinct}) > 1]
        details = "; ".join(
            f"{key}: "
            + ", ".join(
                f"{name}={'/'.join(dict.fromkeys(value_text(w.get(key)) for w in ws))}"
                for name, ws in workloads.items()
            )
            for key in differing
        )
        warnings.append(
            f"the results ran different workloads ({details}), so their figures compare unlike work"
        )
    if unrecorded and len({name for name, _ in named_results}) > 1:
        warnings.append(
            f"no workload recorded in the results of {', '.join(unrecorded)}: cannot check they ran the same workload"
        )
    return warnings


def build_comparison(
    named_results: list[tuple[str, dict[str, Any]]],
    baseline: str | None = None,
    sla: dict[str, float] | None = None,
    allow_cold: bool = False,
) -> Comparison:
    """Group results by target name into sweeps and judge them.

    Several results under one name form that target's sweep (e.g. concurrency 1, 4, 16);
    the baseline defaults to the first target. A result measured without warm-ups
    (``num_warmups`` 0) timed a cold server's first requests: unless ``allow_cold``, the
    verdict names it and picks nothing.
    """
    if not named_results:
        raise ValueError("nothing to compare: give result files or --target endpoints")
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, result in named_results:
        groups.setdefault(name, []).append(add_derived_figures(result))
    for points in groups.values():
        points.sort(key=_sort_key)
    baseline = baseline or next(iter(groups))
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} is not one of the targets: {', '.join(groups)}")
    kinds = {load_of(p)[0] for pts in groups.values() for p in pts} - {"unbounded"}
    load_kind = (
        kinds.pop()
        if len(kinds) == 1
        else ("concurrency" if "concurrency" in kinds else "unbounded")
    )
    sla = sla or {}
    headlines = _headline_points(groups)
    targets = []
    for name, points in groups.items():
        target = TargetSummary(name=name, points=points, headline=headlines[name])
        for i, point in enumerate(points):
            misses = check_sla(point, sla) if sla else []
            if sla and not misses:
                target.sla_points.append(point)
            elif misses:
                target.sla_misses[i] = misses
        targets.append(target)
    verdict, pick = _verdict(targets, baseline, sla, load_kind)
    warnings = workload_warnings(named_results)
    cold = cold_targets(named_results)
    if cold and not allow_cold:
        verdict = (
            f"No verdict: {', '.join(cold)} measured a cold server (--num-warmups 0), whose "
            "first requests pay one-off start-up costs (kernel builds, allocator growth, pages "
            "touched for the first time), so the figures would decide on those. Re-run with "
            "warm-ups (the default), or pass --allow-cold."
        )
        pick = None
    elif cold:
        warnings.append(f"{', '.join(cold)} measured a cold server (--num-warmups 0)")
    return Comparison(targets, baseline, sla, load_kind, verdict, pick, warnings)


def cold_targets(named_results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Targets with a result that recorded no warm-ups (files that do not say are not judged)."""
    cold: list[str] = []
    for name, result in named_results:
        if result.get("num_warmups") == 0 and name not in cold:
            cold.append(name)
    return cold


@dataclass(frozen=True)
class Cell:
    """One target's figure in the side-by-side table."""

    value: float | None
    ratio: float | None
    """value / the baseline's; None for the baseline itself."""
    spread: tuple[float, float] | None
    """(min, max) over rounds; None for a single run."""
    is_clear: bool
    """The difference from the baseline exceeds the noise (see ``is_clear_difference``)."""


def table_rows(comparison: Comparison) -> list[tuple[MetricSpec, list[Cell]]]:
    """For each shown metric: each target's cell, against the baseline's headline point."""
    base = comparison.target(comparison.baseline).headline
    rows = []
    for spec in TABLE_METRICS:
        if all(t.headline.get(spec.key) is None for t in comparison.targets):
            continue
        cells = []
        for target in comparison.targets:
            value = target.headline.get(spec.key)
            base_value = base.get(spec.key)
            ratio = None
            if target.name != comparison.baseline and value is not None and base_value:
                ratio = value / base_value
            is_clear = ratio is not None and is_clear_difference(target.headline, base, spec.key)
            cells.append(Cell(value, ratio, spread_of(target.headline, spec.key), is_clear))
        rows.append((spec, cells))
    return rows


def format_number(value: float | None) -> str:
    """A table figure: two decimals for floats, integers as they are."""
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _cell(cell: Cell) -> str:
    text = format_number(cell.value)
    if cell.spread is not None and cell.spread[0] != cell.spread[1]:
        text += f" [{format_number(cell.spread[0])}-{format_number(cell.spread[1])}]"
    if cell.ratio is not None:
        text += f" ({'' if cell.is_clear else '~'}{cell.ratio:.2f}x)"
    return text


TABLE_LEGEND = "[min-max] over rounds; ~ marks a ratio within noise ({rule})."
"""The line under the table; ``rule`` is ``noise_rule`` of the headline points."""


def format_comparison(comparison: Comparison) -> str:
    """The terminal report: verdict, side-by-side table with ratios, SLA lines."""
    names = [t.name for t in comparison.targets]
    loads = {
        t.name: describe_load(comparison.load_kind, load_of(t.headline)[1])
        for t in comparison.targets
    }
    header = ["Metric"] + [f"{n}{' (baseline)' if n == comparison.baseline else ''}" for n in names]
    body = [[spec.title] + [_cell(c) for c in cells] for spec, cells in table_rows(comparison)]
    body.insert(0, ["Load"] + [loads[n] for n in names])
    body.insert(1, ["Rounds"] + [str(num_rounds_of(t.headline)) for t in comparison.targets])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [f"Verdict: {comparison.verdict}"]
    lines += [f"Warning: {warning}" for warning in comparison.warnings]
    lines.append("")
    for row in [header, ["-" * w for w in widths], *body]:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append(TABLE_LEGEND.format(rule=noise_rule([t.headline for t in comparison.targets])))
    if comparison.sla:
        lines.append("")
        lines.append("SLA: " + ", ".join(f"{k} <= {v:g}" for k, v in comparison.sla.items()))
        for target in comparison.targets:
            if target.meets_sla:
                lines.append(
                    f"  {target.name}: meets it {_within_sla_text(comparison.load_kind, target.max_load_within_sla)}"
                )
            else:
                last = target.sla_misses.get(0, ["no point measured"])
                lines.append(
                    f"  {target.name}: misses it at every load (lowest load: {'; '.join(last)})"
                )
    return "\n".join(lines)
