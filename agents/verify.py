"""Verify: after `verify_after_s`, compare the SLO figures with those before a change.

A unit (the changes one tick applied) is kept when the SLO score (worst
figure / target) did not get worse beyond `regression_tolerance`, and rolled
back, all of it, when it did. Without traffic there is nothing to compare:
the unit waits, and is kept once it has waited twice as long again.
Pure: the graph applies the rollbacks.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from agents.controllers import regressed
from agents.figures import slo_figures, slo_score
from agents.knobs import Change
from agents.memory import Unit
from app.config import AgentsConfig, SLOConfig
from app.telemetry.snapshot import Snapshot

#: A unit without data is kept after waiting this many verify periods.
NO_DATA_PERIODS = 3

Outcome = Literal["kept", "rolled_back", "waiting"]


class Verdict(BaseModel):
    unit: Unit
    outcome: Outcome
    before: float | None
    after: float | None
    after_figures: dict[str, float] = {}

    @property
    def rollback(self) -> list[Change]:
        return [c.reverse() for c in reversed(self.unit.changes)] if self.outcome == "rolled_back" else []

    def describe(self) -> str:
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        return f"SLO score {fmt(self.before)} -> {fmt(self.after)}"


def verify(units: list[Unit], snap: Snapshot, slo: SLOConfig, agents: AgentsConfig) -> list[Verdict]:
    """Verdicts for the units whose verification is due at the snapshot's time."""
    out = []
    figures = slo_figures(snap, slo)
    after = slo_score(figures)
    for unit in units:
        if snap.at < unit.verify_at:
            continue
        outcome: Outcome
        before = slo_score(unit.baseline)
        if after is None or before is None:
            waited_out = snap.at >= unit.applied_at + NO_DATA_PERIODS * max(agents.verify_after_s, 1.0)
            outcome = "kept" if waited_out else "waiting"
        else:
            outcome = "rolled_back" if regressed(before, after, agents.regression_tolerance) else "kept"
        out.append(Verdict(unit=unit, outcome=outcome, before=before, after=after, after_figures=figures))
    return out
