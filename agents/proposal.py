"""A proposal (one specialist's change, with why) and the guard's verdict on it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from agents.knobs import Change
from agents.situations import Evidence


class Proposal(BaseModel):
    specialist: str
    situation: str
    """The situation's name (its runbook)."""
    subject: str = ""
    change: Change
    reason: str
    expected_effect: str
    evidence: list[Evidence]
    severity: int = 1
    streak: int = 1
    """How many ticks the situation has lasted (the guard waits for confirm_ticks)."""
    figure: float | None = None
    """The situation's figure when proposed (Situation.figure)."""
    rollback_of: str | None = None
    """Unit id when this proposal undoes a change that made the SLO worse."""
    group: str = ""
    """Proposals sharing a group go through together or not at all (a replica moved between roles)."""

    @property
    def situation_key(self) -> str:
        return f"{self.situation}:{self.subject}" if self.subject else self.situation


Status = Literal["accepted", "held", "rejected"]


class Decision(BaseModel):
    proposal: Proposal
    status: Status
    reason: str = ""
