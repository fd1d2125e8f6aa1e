"""What one diagnosis works on: the snapshot, config, live knobs and memory, the situations found
so far, and the helpers every check uses (hysteresis, evidence). agents/diagnose.py runs the
checks; agents/breaches.py (the SLO objectives) and agents/intent.py (knobs back to the config's
values) are checks of their own that read what the earlier ones found.
"""

from __future__ import annotations

from agents import figures as f
from agents.memory import Memory
from agents.situations import RECOVERED_SLOWDOWN, SPECIALISTS, WAN_FAILURES, Evidence, Situation
from app.config import AgentsConfig, LiveKnobs, PDDConfig
from app.telemetry.snapshot import Snapshot


class Judge:
    def __init__(self, snap: Snapshot, config: PDDConfig, agents: AgentsConfig, knobs: LiveKnobs, memory: Memory, now: float):
        self.snap, self.config, self.agents, self.knobs, self.memory, self.now = snap, config, agents, knobs, memory, now
        self.found: list[Situation] = []

    def past(self, key: str, value: float | None, band: tuple[float, float]) -> bool:
        """Above the entry threshold, or above the exit threshold while already active."""
        if value is None:
            return False
        return value >= (band[1] if key in self.memory.streaks else band[0])

    def below(self, key: str, value: float | None, band: tuple[float, float]) -> bool:
        if value is None:
            return False
        return value < (band[1] if key in self.memory.streaks else band[0])

    def add(self, name: str, summary: str, evidence: list[Evidence], subject: str = "", severity: int = 1, figure: float | None = None) -> None:
        self.found.append(
            Situation(name=name, subject=subject, summary=summary, severity=severity, figure=figure, evidence=evidence, specialists=list(SPECIALISTS[name]))
        )

    def q(self, name: str) -> str:
        return self.snap.query(name)

    def active(self, *names: str) -> bool:
        """Whether a situation of one of `names` that asks for a change was found so far."""
        return any(s.name in names and s.severity > 0 for s in self.found)

    def worst_link(self) -> f.LinkHealth | None:
        """The WAN link furthest from its model (None: no pulls in the window)."""
        links = f.wan_links(self.snap, self.config)
        return max(links, key=lambda link: link.slowdown) if links else None

    def link_as_configured(self) -> bool:
        """Every WAN link that carried pulls runs near its model and breaks next to none of them (both
        under wan_degradation's exit thresholds): a long gap there is not the link's doing. False without pulls."""
        links = f.wan_links(self.snap, self.config)
        return bool(links) and all(link.slowdown < RECOVERED_SLOWDOWN and link.failure_ratio < WAN_FAILURES[1] for link in links)

    def link_evidence(self) -> list[Evidence]:
        worst = self.worst_link()
        if worst is None:
            return []
        return [
            Evidence(
                query=self.q("kv_slowdown_mean_by_link") if worst.shared else "observed / expected",
                value=worst.slowdown,
                threshold=RECOVERED_SLOWDOWN,
                note=f"{worst.link} pull time / the link model's: near 1, the link is as configured",
            )
        ]

    def gap_error_evidence(self) -> list[Evidence]:
        return [
            Evidence(
                query=self.q("gap_error_mean_by_link"),
                value=err,
                note=f"{link}: P-MD gap less the predicted one, mean s (above 0: the prediction misses part of the stall)",
            )
            for link, err in sorted(self.snap.gap_error_mean_by_link.items())
        ]
