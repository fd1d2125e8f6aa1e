"""What a specialist sees, and how it words a proposal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents.knobs import Change, get_knob, knob_bounds
from agents.memory import Memory
from agents.proposal import Proposal
from agents.situations import Evidence, Situation
from agents.whatif import WhatIf
from app.config import AgentsConfig, KnobBounds, LiveKnobs, PDDConfig
from app.telemetry.snapshot import Snapshot


@dataclass(frozen=True)
class View:
    snap: Snapshot
    config: PDDConfig
    agents: AgentsConfig
    knobs: LiveKnobs
    replicas: dict[str, int]
    """Role name -> replica count now."""
    situations: list[Situation]
    memory: Memory
    what_if: WhatIf | None = None
    proposals: list[Proposal] = field(default_factory=list)
    """What the specialists before this one proposed in this tick."""

    def mine(self, specialist: str) -> list[Situation]:
        return [s for s in self.situations if specialist in s.specialists]

    def active(self, name: str) -> list[Situation]:
        return [s for s in self.situations if s.name == name and s.severity > 0]

    def knob(self, path: str) -> Any:
        return get_knob(self.knobs, path)

    def bounds(self, target: str) -> KnobBounds | None:
        return knob_bounds(self.agents, self.config, target)

    def propose(
        self, specialist: str, situation: Situation, target: str, old: Any, new: Any, reason: str, effect: str, evidence: list[Evidence] | None = None
    ) -> Proposal:
        return Proposal(
            specialist=specialist,
            situation=situation.name,
            subject=situation.subject,
            change=Change(target=target, old=old, new=new),
            reason=reason,
            expected_effect=effect,
            evidence=[*situation.evidence, *(evidence or [])],
            severity=situation.severity,
            streak=situation.streak,
            figure=situation.figure,
        )
