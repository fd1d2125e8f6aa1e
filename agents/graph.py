"""The tick graph: observe -> diagnose -> specialists (swarm handoffs) -> guard ->
persist -> [approve] -> act -> verify -> record.

One graph run is one tick, on its own LangGraph thread (thread id = tick id):
- the SQLite checkpointer keeps every step of every tick, so a tick's thread
  is its complete, self-contained audit record;
- in advise mode the tick stops at `approve` (a LangGraph `interrupt`) and
  waits, for minutes or days, until `pdd agents approve|reject <tick>` resumes
  exactly that thread, while the loop goes on running new ticks on new
  threads. One long thread could hold only one pending approval at a time.
What must carry from tick to tick (cooldowns, streaks, units awaiting
verification) is the agents' memory in the LangGraph store (agents/memory.py).

`persist` writes memory and the action entries before the interrupt: a node
that calls `interrupt` runs again from its start when resumed, so nothing with
side effects may sit in front of the interrupt inside `approve`.

State values are plain JSON (model dumps), so checkpoints read back anywhere.
"""

from __future__ import annotations

import operator
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore
from langgraph.types import Command, interrupt

from agents.actuate import ActuationError, Actuator
from agents.diagnose import Evidence, Situation, diagnose
from agents.entries import EntrySink
from agents.figures import slo_figures
from agents.guard import direction, guard
from agents.knobs import Change, is_notice, is_replicas, kind_of, role_of, with_knobs
from agents.memory import Block, Filed, Growth, Memory, MemoryBackend, Unit, growth_key, record_history
from agents.proposal import Decision, Proposal
from agents.router import Router, hand_to
from agents.specialists import ALL, CLERK, PROPOSERS
from agents.specialists.base import View
from agents.verify import verify
from agents.whatif import WhatIf
from app.config import AgentMode, AgentsConfig, LiveKnobs, PDDConfig
from app.telemetry.snapshot import ObserveError, Snapshot, Source

#: A rolled-back move stays blocked for this many cooldowns, doubled for each rollback of
#: the same move in a row (up to MAX_BLOCK_DOUBLINGS times): otherwise a move that keeps
#: failing, such as shedding a replica the load still needs, returns every few minutes.
BLOCK_COOLDOWNS = 3
MAX_BLOCK_DOUBLINGS = 4
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


def _situations(state: TickState) -> list[Situation]:
    return [Situation.model_validate(s) for s in state.get("situations", [])]


def _decisions(state: TickState) -> list[Decision]:
    return [Decision.model_validate(d) for d in state.get("decisions", [])]


def _brief(state: TickState, candidates: list[str]) -> str:
    lines = [f"Tick {state['tick']} ({state['mode']} mode). Situations:"]
    for s in _situations(state):
        lines.append(f"- {s.key} (severity {s.severity}, {s.streak} ticks): {s.summary}; specialists: {', '.join(s.specialists)}")
    done = state.get("visited", [])
    lines.append(f"Specialists done: {', '.join(done) or 'none'}. Choose the next among: {', '.join(candidates)}.")
    return "\n".join(lines)


def _facts(state: TickState, decisions: list[Decision]) -> str:
    lines = [f"Tick {state['tick']}, {state['mode']} mode."]
    for s in _situations(state):
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


def build_graph(deps: Deps) -> StateGraph:
    cfg, agents = deps.config, deps.agents

    def view(state: TickState, proposals: list[Proposal] | None = None) -> View:
        return View(
            snap=Snapshot.model_validate(state["snapshot"]),
            config=cfg,
            agents=agents,
            knobs=LiveKnobs.model_validate(state["knobs"]),
            replicas=dict(state["replicas"]),
            situations=_situations(state),
            memory=Memory.model_validate(state["memory"]),
            what_if=deps.what_if,
            proposals=proposals or [],
        )

    def next_specialist(state: TickState, visited: list[str]) -> Command:
        open_ = {a for s in _situations(state) for a in s.specialists if a in PROPOSERS}
        candidates = [a for a in PROPOSERS if a in open_ and a not in visited]
        if not candidates:
            return hand_to(CLERK, "every specialist with open situations has proposed")
        agent, why = deps.router.choose(_brief({**state, "visited": visited}, candidates), candidates)
        return hand_to(agent, why)

    def observe(state: TickState) -> Command:
        now = state["now"]
        memory = deps.memory.load().model_dump(mode="json")
        base = {"memory": memory, "memory_saved": memory}
        try:
            snap = deps.source.snapshot(now)
            knobs = deps.actuator.current_knobs()
            replicas = deps.actuator.current_replicas()
        except (ObserveError, ActuationError) as err:
            return Command(goto="record", update={**base, "error": f"observe failed: {err}"})
        return Command(
            goto="diagnose",
            update={
                **base,
                "snapshot": snap.model_dump(mode="json"),
                "knobs": knobs.model_dump(mode="json"),
                "replicas": replicas,
            },
        )

    def diagnose_node(state: TickState) -> Command:
        memory = Memory.model_validate(state["memory"])
        found, streaks = diagnose(Snapshot.model_validate(state["snapshot"]), cfg, agents, LiveKnobs.model_validate(state["knobs"]), memory, state["now"])
        memory.streaks = streaks
        memory.growth = {k: g for k, g in memory.growth.items() if g.situation in streaks}
        memory.filed = {k: f for k, f in memory.filed.items() if f.situation in streaks}
        update = {"situations": [s.model_dump(mode="json") for s in found], "memory": memory.model_dump(mode="json")}
        cmd = next_specialist({**state, **update}, [])
        return Command(goto=cmd.goto, update={**update, **cmd.update})

    def specialist(name: str):
        def run(state: TickState) -> Command:
            so_far = [Proposal.model_validate(p) for p in state.get("proposals", [])]
            proposals = ALL[name](view(state, so_far))
            visited = [*state.get("visited", []), name]
            own = {"visited": [name], "proposals": [p.model_dump(mode="json") for p in proposals]}
            if name == CLERK:
                return Command(goto="guard", update=own)
            cmd = next_specialist(state, visited)
            return Command(goto=cmd.goto, update={**own, **cmd.update})

        return run

    def guard_node(state: TickState) -> dict:
        v = view(state)
        proposals = [Proposal.model_validate(p) for p in state.get("proposals", [])]
        decisions = guard(
            proposals, config=cfg, agents=agents, knobs=v.knobs, replicas=v.replicas, memory=v.memory, now=state["now"], request_rate=v.snap.request_rate
        )
        return {"decisions": [d.model_dump(mode="json") for d in decisions]}

    def persist(state: TickState) -> Command:
        now, mode, tick = state["now"], state["mode"], state["tick"]
        memory = Memory.model_validate(state["memory"])
        accepted = [d for d in _decisions(state) if d.status == "accepted"]
        explanation = deps.router.explain(_facts(state, _decisions(state))) if accepted else ""
        entries: dict[str, str] = {}
        awaiting = False
        for d in accepted:
            target = d.proposal.change.target
            if is_notice(target) or mode == AgentMode.observe.value:
                memory.noted[target] = now
                path = _file_once(memory, d.proposal, tick, mode, now, explanation)
                if path:
                    entries[target] = path
                continue
            if mode == AgentMode.advise.value:
                outcome = f"awaiting approval: pdd agents approve {tick}"
                memory.pending[target] = tick
                awaiting = True
            else:
                outcome = "applying"
            path = deps.entries.file(d.proposal, tick=tick, mode=mode, at=now, outcome=outcome, explanation=explanation)
            if path:
                entries[target] = path
        saved = memory.model_dump(mode="json")
        deps.memory.save(Memory.model_validate(state["memory_saved"]), memory)
        update = {"memory": saved, "memory_saved": saved, "entries": entries, "explanation": explanation}
        if awaiting:
            _history(state | update, "awaiting approval")
            return Command(goto="approve", update=update)
        return Command(goto="act", update=update)

    def _file_once(memory: Memory, p: Proposal, tick: str, mode: str, now: float, explanation: str) -> str | None:
        """File a proposal the agents do not act on, or, when its situation has lasted since the same
        proposal was filed, add to that entry's outcomes; the entry's path. Mutates `memory`."""
        target = p.change.target
        notice = is_notice(target)
        earlier = memory.filed.get(target)
        # the value a controller proposes moves with the figures; from the same live value it is the same proposal
        same = earlier is not None and earlier.situation == p.situation_key and earlier.change.old == p.change.old
        again = AGAIN if notice else f"{PROPOSED_AGAIN}: {p.change.describe()}"
        if same and deps.entries.update(earlier.path, at=now, outcome=f"{again} (tick {tick})"):
            return earlier.path
        path = deps.entries.file(p, tick=tick, mode=mode, at=now, outcome=NOTIFIED if notice else PROPOSED, explanation=explanation)
        if path:
            memory.filed[target] = Filed(situation=p.situation_key, change=p.change, path=path)
        return path

    def approve(state: TickState) -> dict:
        proposals = [d.proposal.model_dump(mode="json") for d in _decisions(state) if d.status == "accepted" and not is_notice(d.proposal.change.target)]
        answer = interrupt({"tick": state["tick"], "proposals": proposals, "explanation": state.get("explanation", "")})
        if not isinstance(answer, dict):
            answer = {"approved": bool(answer)}
        return {"approval": {"approved": bool(answer.get("approved")), "by": str(answer.get("by") or "unknown"), "note": str(answer.get("note") or "")}}

    def act(state: TickState) -> dict:
        mode, tick = state["mode"], state["tick"]
        changes = [d.proposal for d in _decisions(state) if d.status == "accepted" and not is_notice(d.proposal.change.target)]
        if mode == AgentMode.observe.value or not changes:
            return {"applied": []}
        approval = state.get("approval")
        if approval is None:
            memory = Memory.model_validate(state["memory"])
            return _act(state, changes, state["now"], memory, LiveKnobs.model_validate(state["knobs"]), state["snapshot"], "")
        # resumed, possibly much later: judge again against the cluster and memory as they are now
        now = deps.clock()
        base = deps.memory.load()
        memory = base.model_copy(deep=True)
        for p in changes:
            if memory.pending.get(p.change.target) == tick:
                del memory.pending[p.change.target]
        who = approval["by"]
        if not approval["approved"]:
            for p in changes:
                memory.noted[p.change.target] = now
                _update_entry(state, p.change.target, now, f"rejected by {who}" + (f": {approval['note']}" if approval["note"] else ""))
            update: dict[str, Any] = {"applied": []}
        else:
            try:
                knobs, replicas = deps.actuator.current_knobs(), deps.actuator.current_replicas()
                snapshot = deps.source.snapshot(now).model_dump(mode="json")
            except (ObserveError, ActuationError) as err:
                for p in changes:
                    _update_entry(state, p.change.target, now, f"approved by {who}, not applied: {err}")
                deps.memory.save(base, memory)
                return {"applied": [], "error": str(err)}
            fresh = guard(
                [p.model_copy(update={"streak": agents.confirm_ticks}) for p in changes],
                config=cfg,
                agents=agents,
                knobs=knobs,
                replicas=replicas,
                memory=memory,
                now=now,
                request_rate=Snapshot.model_validate(snapshot).request_rate,
            )
            for d in fresh:
                if d.status != "accepted":
                    _update_entry(state, d.proposal.change.target, now, f"approved by {who}, not applied: {d.reason}")
            ok = [d.proposal for d in fresh if d.status == "accepted"]
            update = _act(state, ok, now, memory, knobs, snapshot, f" (approved by {who})")
        deps.memory.save(base, memory)
        saved = memory.model_dump(mode="json")
        return {**update, "memory": saved, "memory_saved": saved}

    def _act(state: TickState, changes: list[Proposal], now: float, memory: Memory, knobs: LiveKnobs, snapshot: dict, who: str) -> dict:
        """Apply accepted changes; register them as one unit to verify. Mutates `memory`."""
        applied, failed = _apply(deps.actuator, [p.change for p in changes], knobs)
        entries = state.get("entries", {})
        snap = Snapshot.model_validate(snapshot)
        by_target = {p.change.target: p for p in changes}
        for change in applied:
            _note_change(memory, change, now)
            p = by_target[change.target]
            if is_replicas(change.target) and direction(change) > 0 and p.figure is not None:
                growth = Growth(situation=p.situation_key, target=change.target, at=now, figure=p.figure, request_rate=snap.request_rate)
                memory.growth[growth_key(growth.situation, growth.target)] = growth
            _update_entry(state, change.target, now, f"applied{who}; verify after {agents.verify_after_s:g} s")
        for change, err in failed:
            _update_entry(state, change.target, now, f"failed: {err}")
        if applied:
            unit = Unit(
                id=f"{state['tick']}/unit",
                tick=state["tick"],
                applied_at=now,
                verify_at=now + agents.verify_after_s,
                changes=applied,
                baseline=slo_figures(snap, cfg.slo),
                entries=[entries[c.target] for c in applied if c.target in entries],
                situations=sorted({p.situation_key for p in changes}),
            )
            memory.units[unit.id] = unit
        return {"applied": [c.model_dump(mode="json") for c in applied], "memory": memory.model_dump(mode="json")}

    def verify_node(state: TickState) -> dict:
        if state.get("approval") is not None or state["mode"] == AgentMode.observe.value:
            return {"verdicts": []}
        now = state["now"]
        memory = Memory.model_validate(state["memory"])
        fresh = {u for u in memory.units if u.startswith(state["tick"] + "/")}
        units = [u for k, u in memory.units.items() if k not in fresh]
        verdicts = verify(units, Snapshot.model_validate(state["snapshot"]), cfg.slo, agents)
        knobs = LiveKnobs.model_validate(state["knobs"])
        for v in verdicts:
            if v.outcome == "waiting":
                continue
            del memory.units[v.unit.id]
            if v.outcome == "kept":
                for c in v.unit.changes:
                    block = memory.blocked.get(c.target)
                    if block is not None and block.direction in (0, direction(c)):
                        del memory.blocked[c.target]  # the move has worked: a later rollback of it starts over
                for path in v.unit.entries:
                    deps.entries.update(path, at=now, outcome=f"kept after verification ({v.describe()})")
                continue
            applied, failed = _apply(deps.actuator, v.rollback, knobs)
            for change in applied:
                _note_change(memory, change, now)
                memory.growth = {k: g for k, g in memory.growth.items() if g.target != change.target}
                way = direction(change.reverse())
                last = memory.blocked.get(change.target)
                strikes = last.strikes + 1 if last is not None and last.direction == way else 1
                span = BLOCK_COOLDOWNS * agents.cooldown_s * 2 ** min(strikes - 1, MAX_BLOCK_DOUBLINGS)
                memory.blocked[change.target] = Block(until=now + span, direction=way, strikes=strikes)
            if failed:
                # keep what did not go back in flight: next tick finds it still worse and tries again
                stuck = {c.target for c, _ in failed}
                memory.units[v.unit.id] = v.unit.model_copy(update={"changes": [c for c in v.unit.changes if c.target in stuck]})
            note = f"rolled back: {v.describe()}" if not failed else f"rollback failed, retried next tick: {'; '.join(str(e) for _, e in failed)}"
            for path in v.unit.entries:
                deps.entries.update(path, at=now, outcome=note)
            name, _, subject = v.unit.situations[0].partition(":")
            for change in applied:
                deps.entries.file(
                    Proposal(
                        specialist="verify",
                        situation=name,
                        subject=subject,
                        change=change,
                        reason=f"the change made the SLO worse ({v.describe()})",
                        expected_effect="SLO figures return to where they were before the change",
                        evidence=[
                            Evidence(query=SCORE_QUERY, value=v.before, note="before the change"),
                            Evidence(query=SCORE_QUERY, value=v.after, note=f"{agents.verify_after_s:g} s or more after it"),
                        ],
                        rollback_of=v.unit.id,
                    ),
                    tick=state["tick"],
                    mode=state["mode"],
                    at=now,
                    outcome="applied (rollback)",
                    explanation="",
                )
        return {"verdicts": [v.model_dump(mode="json") for v in verdicts], "memory": memory.model_dump(mode="json")}

    def record(state: TickState) -> dict:
        memory = Memory.model_validate(state["memory"])
        deps.memory.save(Memory.model_validate(state["memory_saved"]), memory)
        saved = memory.model_dump(mode="json")
        status = "error" if state.get("error") else "done"
        _history({**state, "memory": saved}, status)
        return {"memory_saved": saved}

    def _update_entry(state: TickState, target: str, at: float, outcome: str) -> None:
        path = state.get("entries", {}).get(target)
        if path:
            deps.entries.update(path, at=at, outcome=outcome)

    def _history(state: TickState, status: str) -> None:
        if deps.store is None:
            return
        decisions = _decisions(state)
        record_history(
            deps.store,
            state["tick"],
            {
                "tick": state["tick"],
                "at": state["now"],
                "mode": state["mode"],
                "status": status,
                "error": state.get("error"),
                "situations": [s.key for s in _situations(state)],
                "decisions": [f"{d.status}: {d.proposal.change.describe()}" + (f" ({d.reason})" if d.reason else "") for d in decisions],
                "applied": [Change.model_validate(c).describe() for c in state.get("applied", [])],
                "verdicts": [f"{v['unit']['id']}: {v['outcome']}" for v in state.get("verdicts", [])],
                "explanation": state.get("explanation", ""),
            },
        )

    g = StateGraph(TickState)
    g.add_node("observe", observe, destinations=("diagnose", "record"))
    g.add_node("diagnose", diagnose_node, destinations=tuple(ALL))
    for name in PROPOSERS:
        g.add_node(name, specialist(name), destinations=tuple(a for a in ALL if a != name))
    g.add_node(CLERK, specialist(CLERK), destinations=("guard",))
    g.add_node("guard", guard_node)
    g.add_node("persist", persist, destinations=("approve", "act"))
    g.add_node("approve", approve)
    g.add_node("act", act)
    g.add_node("verify", verify_node)
    g.add_node("record", record)
    g.add_edge(START, "observe")
    g.add_edge("guard", "persist")
    g.add_edge("approve", "act")
    g.add_edge("act", "verify")
    g.add_edge("verify", "record")
    g.add_edge("record", END)
    return g


def _note_change(memory: Memory, change: Change, now: float) -> None:
    memory.last_change[change.target] = now
    if direction(change) > 0:
        memory.raised[change.target] = now


def _apply(actuator: Actuator, changes: list[Change], knobs: LiveKnobs) -> tuple[list[Change], list[tuple[Change, Exception]]]:
    """Knob changes in one redeploy, then each replica change; what went through and what failed."""
    applied: list[Change] = []
    failed: list[tuple[Change, Exception]] = []
    knob_changes = [c for c in changes if kind_of(c.target) in ("knob", "choice")]
    if knob_changes:
        try:
            actuator.set_knobs(with_knobs(knobs, {c.target: c.new for c in knob_changes}))
            applied += knob_changes
        except (ActuationError, ValueError) as err:
            failed += [(c, err) for c in knob_changes]
    for c in changes:
        if is_replicas(c.target):
            try:
                actuator.scale(role_of(c.target), int(c.new))
                applied.append(c)
            except ActuationError as err:
                failed.append((c, err))
    return applied, failed
