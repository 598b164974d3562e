"""The front end's ``/metrics``: every replica's series with a ``replica`` label, their
aggregate without it, and the front end's own routing and supervision counters.

Aggregates are sums (counters, histograms, gauges of counts), except gauges of a fraction
(``*_perc``), which are averaged over the replicas that answered. In PromQL select one view:
``{replica=""}`` (aggregate) or ``{replica!=""}`` (per replica), never sum both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

FRONT_PREFIX = "tokenmill:dp_"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), chr(92) + "n")}"'
        for k, v in labels.items()
    )
    return "{" + inner + "}"


def _number(value: float) -> str:
    return repr(float(value)) if value == value else "NaN"  # NaN is not equal to itself


@dataclass
class _Family:
    kind: str
    doc: str
    aggregate: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = field(
        default_factory=dict
    )
    per_replica: list[str] = field(default_factory=list)


def merge_replica_metrics(texts: Mapping[int, str] | Mapping[str, str]) -> str:
    """One exposition text from each replica's, keyed by what labels it (an index, or Ray's
    replica tag); the aggregate sums those given."""
    families: dict[str, _Family] = {}
    for replica, text in sorted(texts.items(), key=lambda item: str(item[0])):
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, _Family(family.type, family.documentation))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # creation timestamps neither sum nor matter here
                labels = dict(sample.labels)
                key = (sample.name, tuple(sorted(labels.items())))
                entry.aggregate.setdefault(key, []).append(sample.value)
                labels["replica"] = str(replica)
                entry.per_replica.append(f"{sample.name}{_labels(labels)} {_number(sample.value)}")
    lines: list[str] = []
    for name, entry in families.items():
        lines.append(f"# HELP {name} {entry.doc}")
        lines.append(f"# TYPE {name} {entry.kind}")
        is_fraction = entry.kind == "gauge" and name.endswith("_perc")
        for (sample_name, label_items), values in entry.aggregate.items():
            value = sum(values) / len(values) if is_fraction else sum(values)
            lines.append(f"{sample_name}{_labels(dict(label_items))} {_number(value)}")
        lines.extend(entry.per_replica)
    return "\n".join(lines) + "\n" if lines else ""


@dataclass
class FrontMetrics:
    """What the front end itself counts: routing decisions, retries, failures, restarts."""

    routed: Counter[tuple[int, str]] = field(default_factory=Counter)
    """(replica, reason) -> requests; reason: prefix, least_loaded or round_robin."""
    num_retried: int = 0
    num_failed_in_flight: int = 0
    num_no_replica: int = 0

    def render(self, up: list[bool], restarts: list[int]) -> str:
        p = FRONT_PREFIX
        lines = [
            f"# HELP {p}replica_up Whether the replica answers /health with 200 (takes requests).",
            f"# TYPE {p}replica_up gauge",
            *(f'{p}replica_up{{replica="{i}"}} {float(u)}' for i, u in enumerate(up)),
            f"# HELP {p}replica_restarts Times the supervisor restarted the replica.",
            f"# TYPE {p}replica_restarts counter",
            *(
                f'{p}replica_restarts_total{{replica="{i}"}} {float(n)}'
                for i, n in enumerate(restarts)
            ),
            f"# HELP {p}requests_routed Requests sent to each replica, by why it was chosen.",
            f"# TYPE {p}requests_routed counter",
            *(
                f'{p}requests_routed_total{{replica="{i}",reason="{reason}"}} {float(n)}'
                for (i, reason), n in sorted(self.routed.items())
            ),
            f"# HELP {p}requests_retried Requests that had not started on a replica and were "
            "sent to another.",
            f"# TYPE {p}requests_retried counter",
            f"{p}requests_retried_total {float(self.num_retried)}",
            f"# HELP {p}requests_failed_in_flight Requests cut off by their replica's failure "
            "(the client got an error).",
            f"# TYPE {p}requests_failed_in_flight counter",
            f"{p}requests_failed_in_flight_total {float(self.num_failed_in_flight)}",
            f"# HELP {p}requests_no_replica Requests refused with 503: no replica became ready "
            "within --dp-retry-timeout.",
            f"# TYPE {p}requests_no_replica counter",
            f"{p}requests_no_replica_total {float(self.num_no_replica)}",
        ]
        return "\n".join(lines) + "\n"
