"""What a specialist sees, and how it words a proposal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents.controllers import step_toward
from agents.knobs import Change, fmt, get_knob, knob_bounds
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

    def restore(self, specialist: str, situation: Situation, effects: tuple[str, str]) -> list[Proposal]:
        """One bounded step of the knob a `return_to_intent` situation is about (its subject) back
        towards the config's value (agents/intent.py judged that the figures leave room);
        `effects`: what raising it, and what lowering it, does."""
        target = situation.subject
        bounds = self.bounds(target)
        if bounds is None:
            return []
        current, intent = self.knob(target), get_knob(self.config.live_knobs(), target)
        new = step_toward(target, current, intent, bounds)
        if new is None or new == current:
            return []
        effect = effects[0] if new > current else effects[1]
        return [self.propose(specialist, situation, target, current, new, f"{target} returns towards the configured {fmt(intent)}", effect)]
