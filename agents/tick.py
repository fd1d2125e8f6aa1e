"""One tick's state and what its nodes are given: the state schema, the dependencies, helpers over the state."""

from __future__ import annotations

import operator
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, TypedDict

from langgraph.store.base import BaseStore

from agents.actuate import Actuator
from agents.entries import EntrySink
from agents.memory import MemoryBackend
from agents.proposal import Decision
from agents.router import Router
from agents.situations import Situation
from agents.whatif import WhatIf
from app.config import AgentMode, AgentsConfig, PDDConfig
from app.telemetry.snapshot import Source

SCORE_QUERY = "SLO score: max of ttft_p, tpot_p, gap_p over their targets"
NOTIFIED = "notified: a person follows the runbook"
AGAIN = "still so: the situation persists"
PROPOSED = "proposed (observe mode: not applied)"
PROPOSED_AGAIN = "proposed again (observe mode: not applied): the situation persists"


class TickState(TypedDict, total=False):
    tick: str
    mode: str
    now: float
    error: str
    snapshot: dict
    knobs: dict
    replicas: dict[str, int]
    memory: dict
    memory_saved: dict
    situations: list[dict]
    active_agent: str
    visited: Annotated[list[str], operator.add]
    route: Annotated[list[dict], operator.add]
    proposals: Annotated[list[dict], operator.add]
    decisions: list[dict]
    entries: dict[str, str]
    """Target -> runbook action entry file of its accepted proposal."""
    explanation: str
    approval: dict
    applied: list[dict]
    verdicts: list[dict]


@dataclass
class Deps:
    config: PDDConfig
    agents: AgentsConfig
    source: Source
    actuator: Actuator
    memory: MemoryBackend
    entries: EntrySink
    router: Router
    what_if: WhatIf | None = None
    store: BaseStore | None = None
    """Where tick summaries go for `pdd agents history` (None: nowhere)."""
    clock: Callable[[], float] = field(default=time.time)


def new_tick_id(now: float) -> str:
    stamp = datetime.fromtimestamp(now, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return f"tick-{stamp}-{uuid.uuid4().hex[:6]}"


def situations_of(state: TickState) -> list[Situation]:
    return [Situation.model_validate(s) for s in state.get("situations", [])]


def decisions_of(state: TickState) -> list[Decision]:
    return [Decision.model_validate(d) for d in state.get("decisions", [])]


def brief(state: TickState, candidates: list[str]) -> str:
    lines = [f"Tick {state['tick']} ({state['mode']} mode). Situations:"]
    for s in situations_of(state):
        lines.append(f"- {s.key} (severity {s.severity}, {s.streak} ticks): {s.summary}; specialists: {', '.join(s.specialists)}")
    done = state.get("visited", [])
    lines.append(f"Specialists done: {', '.join(done) or 'none'}. Choose the next among: {', '.join(candidates)}.")
    return "\n".join(lines)


def facts(state: TickState, decisions: list[Decision]) -> str:
    lines = [f"Tick {state['tick']}, {state['mode']} mode."]
    for s in situations_of(state):
        lines.append(f"Seen: {s.summary} ({s.name}, {s.streak} ticks).")
    for d in decisions:
        p = d.proposal
        if d.status == "accepted":
            verb = "Changing" if state["mode"] == AgentMode.act.value else "Proposed"
        else:
            verb = d.status.capitalize()
        lines.append(
            f"{verb} by {p.specialist}: {p.change.describe()}, because {p.reason}; expected: {p.expected_effect}." + (f" ({d.reason})" if d.reason else "")
        )
    return " ".join(lines)
