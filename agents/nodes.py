"""The tick graph's nodes, each a function of (state, deps); agents/graph.py wires them.

observe -> diagnose -> specialists (swarm handoffs) -> guard -> persist ->
[approve] -> act -> verify -> record. Nodes read and return plain JSON state
(agents/tick.py); memory and entries are written only by persist, act, verify
and record.
"""

from __future__ import annotations

from typing import Any

from langgraph.types import Command, interrupt

from agents.actuate import ActuationError, Actuator
from agents.diagnose import diagnose
from agents.figures import slo_figures
from agents.guard import block_rolled_back, direction, guard
from agents.knobs import Change, is_notice, is_replicas, kind_of, role_of, with_knobs
from agents.memory import Filed, Growth, Memory, Unit, growth_key, record_history
from agents.proposal import Proposal
from agents.router import hand_to
from agents.situations import Evidence
from agents.specialists import ALL, CLERK, PROPOSERS
from agents.specialists.base import View
from agents.tick import (
    AGAIN,
    NOTIFIED,
    PROPOSED,
    PROPOSED_AGAIN,
    SCORE_QUERY,
    Deps,
    TickState,
    brief,
    decisions_of,
    facts,
    situations_of,
)
from agents.verify import verify
from app.config import AgentMode, LiveKnobs
from app.telemetry.snapshot import ObserveError, Snapshot


def view(state: TickState, deps: Deps, proposals: list[Proposal] | None = None) -> View:
    return View(
        snap=Snapshot.model_validate(state["snapshot"]),
        config=deps.config,
        agents=deps.agents,
        knobs=LiveKnobs.model_validate(state["knobs"]),
        replicas=dict(state["replicas"]),
        situations=situations_of(state),
        memory=Memory.model_validate(state["memory"]),
        what_if=deps.what_if,
        proposals=proposals or [],
    )


def next_specialist(state: TickState, visited: list[str], deps: Deps) -> Command:
    open_ = {a for s in situations_of(state) for a in s.specialists if a in PROPOSERS}
    candidates = [a for a in PROPOSERS if a in open_ and a not in visited]
    if not candidates:
        return hand_to(CLERK, "every specialist with open situations has proposed")
    agent, why = deps.router.choose(brief({**state, "visited": visited}, candidates), candidates)
    return hand_to(agent, why)


def handoff_update(cmd: Command) -> dict[str, Any]:
    """The state update of a handoff's Command (router.hand_to's always has one)."""
    assert isinstance(cmd.update, dict)
    return cmd.update


def observe(state: TickState, deps: Deps) -> Command:
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


def diagnose_node(state: TickState, deps: Deps) -> Command:
    memory = Memory.model_validate(state["memory"])
    found, streaks = diagnose(
        Snapshot.model_validate(state["snapshot"]), deps.config, deps.agents, LiveKnobs.model_validate(state["knobs"]), memory, state["now"]
    )
    memory.streaks = streaks
    memory.growth = {k: g for k, g in memory.growth.items() if g.situation in streaks}
    memory.filed = {k: f for k, f in memory.filed.items() if f.situation in streaks}
    update: TickState = {"situations": [s.model_dump(mode="json") for s in found], "memory": memory.model_dump(mode="json")}
    cmd = next_specialist({**state, **update}, [], deps)
    return Command(goto=cmd.goto, update={**update, **handoff_update(cmd)})


def run_specialist(state: TickState, deps: Deps, name: str) -> Command:
    """Specialist `name` proposes from the tick's view, then hands to the next (the clerk ends at the guard)."""
    so_far = [Proposal.model_validate(p) for p in state.get("proposals", [])]
    proposals = ALL[name](view(state, deps, so_far))
    visited = [*state.get("visited", []), name]
    own = {"visited": [name], "proposals": [p.model_dump(mode="json") for p in proposals]}
    if name == CLERK:
        return Command(goto="guard", update=own)
    cmd = next_specialist(state, visited, deps)
    return Command(goto=cmd.goto, update={**own, **handoff_update(cmd)})


def guard_node(state: TickState, deps: Deps) -> dict:
    v = view(state, deps)
    proposals = [Proposal.model_validate(p) for p in state.get("proposals", [])]
    decisions = guard(
        proposals,
        config=deps.config,
        agents=deps.agents,
        knobs=v.knobs,
        replicas=v.replicas,
        memory=v.memory,
        now=state["now"],
        request_rate=v.snap.request_rate,
    )
    return {"decisions": [d.model_dump(mode="json") for d in decisions]}


def persist(state: TickState, deps: Deps) -> Command:
    now, mode, tick = state["now"], state["mode"], state["tick"]
    memory = Memory.model_validate(state["memory"])
    accepted = [d for d in decisions_of(state) if d.status == "accepted"]
    explanation = deps.router.explain(facts(state, decisions_of(state))) if accepted else ""
    entries: dict[str, str] = {}
    awaiting = False
    for d in accepted:
        target = d.proposal.change.target
        if is_notice(target) or mode == AgentMode.observe.value:
            memory.noted[target] = now
            path = file_once(memory, d.proposal, tick, mode, now, explanation, deps)
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
    update: TickState = {"memory": saved, "memory_saved": saved, "entries": entries, "explanation": explanation}
    if awaiting:
        history(state | update, "awaiting approval", deps)
        return Command(goto="approve", update=update)
    return Command(goto="act", update=update)


def file_once(memory: Memory, p: Proposal, tick: str, mode: str, now: float, explanation: str, deps: Deps) -> str | None:
    """File a proposal the agents do not act on, or, when its situation has lasted since the same
    proposal was filed, add to that entry's outcomes; the entry's path. Mutates `memory`."""
    target = p.change.target
    notice = is_notice(target)
    earlier = memory.filed.get(target)
    again = AGAIN if notice else f"{PROPOSED_AGAIN}: {p.change.describe()}"
    # the value a controller proposes moves with the figures; from the same live value it is the same proposal
    if earlier is not None and earlier.situation == p.situation_key and earlier.change.old == p.change.old:
        if deps.entries.update(earlier.path, at=now, outcome=f"{again} (tick {tick})"):
            return earlier.path
    path = deps.entries.file(p, tick=tick, mode=mode, at=now, outcome=NOTIFIED if notice else PROPOSED, explanation=explanation)
    if path:
        memory.filed[target] = Filed(situation=p.situation_key, change=p.change, path=path)
    return path


def approve(state: TickState) -> dict:
    proposals = [d.proposal.model_dump(mode="json") for d in decisions_of(state) if d.status == "accepted" and not is_notice(d.proposal.change.target)]
    answer = interrupt({"tick": state["tick"], "proposals": proposals, "explanation": state.get("explanation", "")})
    if not isinstance(answer, dict):
        answer = {"approved": bool(answer)}
    return {"approval": {"approved": bool(answer.get("approved")), "by": str(answer.get("by") or "unknown"), "note": str(answer.get("note") or "")}}


def act(state: TickState, deps: Deps) -> dict:
    mode, tick = state["mode"], state["tick"]
    changes = [d.proposal for d in decisions_of(state) if d.status == "accepted" and not is_notice(d.proposal.change.target)]
    if mode == AgentMode.observe.value or not changes:
        return {"applied": []}
    approval = state.get("approval")
    if approval is None:
        memory = Memory.model_validate(state["memory"])
        return act_on(state, changes, state["now"], memory, LiveKnobs.model_validate(state["knobs"]), state["snapshot"], "", deps)
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
            update_entry(state, p.change.target, now, f"rejected by {who}" + (f": {approval['note']}" if approval["note"] else ""), deps)
        update: dict[str, Any] = {"applied": []}
    else:
        try:
            knobs, replicas = deps.actuator.current_knobs(), deps.actuator.current_replicas()
            snapshot = deps.source.snapshot(now).model_dump(mode="json")
        except (ObserveError, ActuationError) as err:
            for p in changes:
                update_entry(state, p.change.target, now, f"approved by {who}, not applied: {err}", deps)
            deps.memory.save(base, memory)
            return {"applied": [], "error": str(err)}
        fresh = guard(
            [p.model_copy(update={"streak": deps.agents.confirm_ticks}) for p in changes],
            config=deps.config,
            agents=deps.agents,
            knobs=knobs,
            replicas=replicas,
            memory=memory,
            now=now,
            request_rate=Snapshot.model_validate(snapshot).request_rate,
        )
        for d in fresh:
            if d.status != "accepted":
                update_entry(state, d.proposal.change.target, now, f"approved by {who}, not applied: {d.reason}", deps)
        ok = [d.proposal for d in fresh if d.status == "accepted"]
        update = act_on(state, ok, now, memory, knobs, snapshot, f" (approved by {who})", deps)
    deps.memory.save(base, memory)
    saved = memory.model_dump(mode="json")
    return {**update, "memory": saved, "memory_saved": saved}


def act_on(state: TickState, changes: list[Proposal], now: float, memory: Memory, knobs: LiveKnobs, snapshot: dict, who: str, deps: Deps) -> dict:
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
        update_entry(state, change.target, now, f"applied{who}; verify after {deps.agents.verify_after_s:g} s", deps)
    for change, err in failed:
        update_entry(state, change.target, now, f"failed: {err}", deps)
    if applied:
        unit = Unit(
            id=f"{state['tick']}/unit",
            tick=state["tick"],
            applied_at=now,
            verify_at=now + deps.agents.verify_after_s,
            changes=applied,
            baseline=slo_figures(snap, deps.config.slo),
            entries=[entries[c.target] for c in applied if c.target in entries],
            situations=sorted({p.situation_key for p in changes}),
        )
        memory.units[unit.id] = unit
    return {"applied": [c.model_dump(mode="json") for c in applied], "memory": memory.model_dump(mode="json")}


def verify_node(state: TickState, deps: Deps) -> dict:
    if state.get("approval") is not None or state["mode"] == AgentMode.observe.value:
        return {"verdicts": []}
    now = state["now"]
    memory = Memory.model_validate(state["memory"])
    fresh = {u for u in memory.units if u.startswith(state["tick"] + "/")}
    units = [u for k, u in memory.units.items() if k not in fresh]
    verdicts = verify(units, Snapshot.model_validate(state["snapshot"]), deps.config.slo, deps.agents)
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
            block_rolled_back(memory, change, now, deps.agents.cooldown_s)
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
                        Evidence(query=SCORE_QUERY, value=v.after, note=f"{deps.agents.verify_after_s:g} s or more after it"),
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


def record(state: TickState, deps: Deps) -> dict:
    memory = Memory.model_validate(state["memory"])
    deps.memory.save(Memory.model_validate(state["memory_saved"]), memory)
    saved = memory.model_dump(mode="json")
    status = "error" if state.get("error") else "done"
    history({**state, "memory": saved}, status, deps)
    return {"memory_saved": saved}


def update_entry(state: TickState, target: str, at: float, outcome: str, deps: Deps) -> None:
    path = state.get("entries", {}).get(target)
    if path:
        deps.entries.update(path, at=at, outcome=outcome)


def history(state: TickState, status: str, deps: Deps) -> None:
    if deps.store is None:
        return
    decisions = decisions_of(state)
    record_history(
        deps.store,
        state["tick"],
        {
            "tick": state["tick"],
            "at": state["now"],
            "mode": state["mode"],
            "status": status,
            "error": state.get("error"),
            "situations": [s.key for s in situations_of(state)],
            "decisions": [f"{d.status}: {d.proposal.change.describe()}" + (f" ({d.reason})" if d.reason else "") for d in decisions],
            "applied": [Change.model_validate(c).describe() for c in state.get("applied", [])],
            "verdicts": [f"{v['unit']['id']}: {v['outcome']}" for v in state.get("verdicts", [])],
            "explanation": state.get("explanation", ""),
        },
    )


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
