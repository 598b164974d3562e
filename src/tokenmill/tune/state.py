"""The search's record: what is known of each candidate, and the whole run as ``result.json``.

Each candidate's replays, gate and plan as they were measured; saved after every
measurement and taken back (``absorb``) by a resumed search, so nothing is measured twice.
The tie-break's "simpler and cheaper" (``simplicity_key``) reads it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.tune.candidates import Candidate
from tokenmill.tune.scoring import peak_rss

STATE_FORMAT_VERSION = 1


@dataclass
class CandidateState:
    """Everything known about one candidate; what ``result.json`` lists."""

    candidate: Candidate
    origin: str = "space"
    """``space`` (from the search space) or ``refined`` (added between two measured values)."""
    status: str = "pending"
    """pending, pruned, rejected, failed, eliminated, finalist, unstable, tied, winner."""
    reason: str = ""
    """Why it was pruned, rejected, failed or lost."""
    memory_bytes: int | None = None
    """Planned memory (weights plus KV) from ``plan``."""
    gate: dict[str, Any] | None = None
    """The correctness check's figures, for reduced precisions."""
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``"<num_requests>/<round>"`` -> that replay's figures."""

    def rung_figures(self, num_requests: int) -> list[dict[str, Any]]:
        """Figures of every round replayed with ``num_requests`` requests."""
        prefix = f"{num_requests}/"
        return [v for k, v in sorted(self.runs.items()) if k.startswith(prefix)]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.candidate.key,
            "origin": self.origin,
            "settings": self.candidate.options,
            "non_default": dict(self.candidate.settings),
            "serve_args": self.candidate.serve_args(),
            "status": self.status,
            "reason": self.reason,
            "memory_bytes": self.memory_bytes,
            "gate": self.gate,
            "runs": self.runs,
        }


def memory_of(state: CandidateState) -> tuple[int, str]:
    """(bytes, what they are): the highest peak RSS its replays measured where the server
    reported one, else the plan's figure. The plan is an upper bound (weights plus the KV
    the whole trace could ask for, capped at the pool), the same for every candidate that
    shares a pool, so it cannot tell apart what the replays did."""
    measured = peak_rss(state.runs.values())
    if measured is not None:
        return measured, "peak RSS measured"
    return state.memory_bytes or 0, "planned"


def simplicity_key(state: CandidateState) -> tuple[int, int]:
    """Tie-break: fewer non-default flags first, then less memory (``memory_of``)."""
    return (state.candidate.num_non_default, memory_of(state)[0])


@dataclass
class TuneState:
    """The search's record: every candidate's state plus the run's settings; saved as JSON."""

    candidates: dict[str, CandidateState]
    meta: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """Search seconds spent before this process (resume adds to it)."""
    decision: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(cls, candidates: list[Candidate], meta: dict[str, Any]) -> TuneState:
        return cls({c.key: CandidateState(c) for c in candidates}, dict(meta))

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": STATE_FORMAT_VERSION,
            "kind": "tune",
            **self.meta,
            "elapsed_s": round(self.elapsed_s, 3),
            "decision": self.decision,
            "candidates": [s.to_json() for s in self.candidates.values()],
        }

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        tmp.replace(out)
        return out

    def absorb(self, path: str | Path, same: tuple[str, ...] = ("model", "workload", "sla")) -> int:
        """Take the gate results and measurements of a previous run of the same search.

        Only a run with the same model, workload and SLA is taken (its numbers would mean
        something else otherwise); returns how many measurements were taken over.
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("kind") != "tune" or any(data.get(k) != self.meta.get(k) for k in same):
            raise ValueError(
                f"{path} is from another search (model, workload or SLA differ); "
                "use another --output-dir"
            )
        taken = 0
        for entry in data.get("candidates", []):
            state = self.candidates.get(entry.get("key"))
            if state is None and entry.get("origin") == "refined":
                # the refinement will ask for it again: keep what it measured
                refined = Candidate(tuple(sorted((entry.get("non_default") or {}).items())))
                state = self.candidates[refined.key] = CandidateState(refined, origin="refined")
            if state is None:
                continue
            state.runs.update(entry.get("runs") or {})
            state.gate = entry.get("gate") or state.gate
            if entry.get("status") == "failed":
                state.status, state.reason = "failed", entry.get("reason", "")
            taken += len(entry.get("runs") or {})
        self.elapsed_s = float(data.get("elapsed_s") or 0.0)
        return taken
