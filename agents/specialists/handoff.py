"""Handoff specialist: handoff mode, catch-up threshold, relay cap.

- RLD overload: relays must end sooner. A forced catch-up mode goes back to
  auto (which hands over in one shot under load, freeing the relay soonest);
  otherwise the relay cap comes down one step.
- WAN degradation: the relay must last as long as MD waits for the KV; the
  cap rises to cover the observed transfer time at the observed TPOT (unless
  RLD is overloaded: then a longer relay would make that worse).
- Recovered (RLD load back under half, or the WAN back near its model): the
  cap returns to the configured value, one step at a time.
"""

from __future__ import annotations

from agents import figures as f
from agents.controllers import lower_by_step, relay_cap_goal, step_toward
from agents.proposal import Proposal
from agents.situations import RLD_OVERLOAD, WAN_DEGRADATION, Evidence, Situation
from agents.specialists.base import View
from app.config import HandoffMode

NAME = "handoff"
MODE = "handoff.mode"
RELAY_CAP = "handoff.relay_cap_tokens"


def _overload(view: View, s: Situation) -> list[Proposal]:
    if s.severity == 0:
        return _restore(view, s, "RLD has headroom again")
    if view.knob(MODE) == HandoffMode.catch_up.value:
        return [
            view.propose(
                NAME,
                s,
                MODE,
                HandoffMode.catch_up.value,
                HandoffMode.auto.value,
                "catch-up keeps relays running longer; auto hands over in one shot while RLD is loaded",
                "relays end sooner: RLD load falls",
            )
        ]
    bounds = view.bounds(RELAY_CAP)
    if bounds is None:
        return []
    current = view.knob(RELAY_CAP)
    floor = max(bounds.min, view.knob("handoff.min_relay_cap_tokens"))
    new = lower_by_step(RELAY_CAP, current, bounds.model_copy(update={"min": floor}))
    if new is None:
        return []
    return [
        view.propose(
            NAME,
            s,
            RELAY_CAP,
            current,
            new,
            f"relay decoders saturated; each relay may produce at most {new} tokens",
            "relays end sooner: RLD load and queueing fall",
        )
    ]


def _wan(view: View, s: Situation) -> list[Proposal]:
    bounds = view.bounds(RELAY_CAP)
    if bounds is None:
        return []
    current = view.knob(RELAY_CAP)
    if s.severity == 0:
        if current <= view.config.handoff.relay_cap_tokens:
            return []
        return _restore(view, s, "WAN recovered")
    if view.active(RLD_OVERLOAD):
        return []
    link = {x.link: x for x in f.wan_links(view.snap, view.config)}.get(s.subject)
    tpot = view.snap.tpot_p_by_pipeline.get(f.P_RLD_MD, view.snap.tpot_p)
    if link is None or not tpot:
        return []
    transfer = link.p90_s if link.p90_s is not None else link.observed_s
    goal = relay_cap_goal(transfer, tpot)
    if goal <= current:
        return []
    new = step_toward(RELAY_CAP, current, goal, bounds)
    if new is None or new <= current:
        return []
    return [
        view.propose(
            NAME,
            s,
            RELAY_CAP,
            current,
            new,
            f"a {transfer:.2f} s pull at {tpot * 1000:.0f} ms/token needs ~{goal} relay tokens",
            "RLD keeps streaming until MD holds the KV: no stall at the relay cap, worst-gap p99 falls",
            [Evidence(query="transfer p90 / TPOT x margin", value=goal, note="relay tokens needed")],
        )
    ]


def _restore(view: View, s: Situation, why: str) -> list[Proposal]:
    """The relay cap one step back towards the configured value."""
    bounds = view.bounds(RELAY_CAP)
    if bounds is None:
        return []
    current = view.knob(RELAY_CAP)
    intent = view.config.handoff.relay_cap_tokens
    new = step_toward(RELAY_CAP, current, intent, bounds)
    if new is None:
        return []
    return [view.propose(NAME, s, RELAY_CAP, current, new, f"{why}; relay cap returns towards the configured {intent}", "relays run as configured again")]


def propose(view: View) -> list[Proposal]:
    out: list[Proposal] = []
    for s in view.mine(NAME):
        if s.name == RLD_OVERLOAD:
            out += _overload(view, s)
        elif s.name == WAN_DEGRADATION and not any(p.change.target == RELAY_CAP for p in out):
            out += _wan(view, s)
    return out
