"""Handoff specialist: handoff mode, catch-up threshold, relay cap.

- RLD overload: relays must end sooner. A forced catch-up mode goes back to
  auto (which hands over in one shot under load, freeing the relay soonest);
  otherwise the relay cap comes down one step.
- WAN degradation: the relay must last as long as MD waits for the KV; the
  cap rises to cover the observed transfer time at the observed TPOT (unless
  RLD is overloaded: then a longer relay would make that worse).
- Gap breach on P-RLD-MD (the stream stalls at the handoff): relays that run to
  their cap stop before MD holds the KV, so the cap rises one step; otherwise a
  one-shot handoff, which stalls while MD recomputes every relayed token, goes
  to auto (two steps while RLD has headroom).
- Return to intent (what moved the cap has cleared and the figures leave room,
  agents/intent.py): the cap returns to the configured value, one step at a time.
  The mode has no step and stays where a situation set it.
"""

from __future__ import annotations

from agents import figures as f
from agents.controllers import lower_by_step, raise_by_step, relay_cap_goal, step_toward
from agents.proposal import Proposal
from agents.situations import GAP_BREACH, RELAY_AT_CAP, RETURN_TO_INTENT, RLD_OVERLOAD, WAN_DEGRADATION, Evidence, Situation
from agents.specialists.base import View
from app.config import HandoffMode

NAME = "handoff"
MODE = "handoff.mode"
RELAY_CAP = "handoff.relay_cap_tokens"
KNOBS = (MODE, RELAY_CAP)
"""The live knobs this specialist moves."""


def _overload(view: View, s: Situation) -> list[Proposal]:
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


def _gap(view: View, s: Situation) -> list[Proposal]:
    """P-RLD-MD's gaps over the target: the stream stalls at the handoff (agents/breaches.py names why)."""
    if s.subject != f.P_RLD_MD:
        return []
    use = f.relay_cap_use(view.snap, view.config, view.knobs.handoff)
    bounds = view.bounds(RELAY_CAP)
    if use is not None and use >= RELAY_AT_CAP and bounds is not None:
        current = view.knob(RELAY_CAP)
        new = raise_by_step(RELAY_CAP, current, bounds)
        if new is not None and new > current:
            return [
                view.propose(
                    NAME,
                    s,
                    RELAY_CAP,
                    current,
                    new,
                    f"relays run to their cap ({use:.0%} of it at p90): RLD stops before MD holds the KV and the stream waits; the cap rises one step",
                    "RLD keeps streaming until MD holds the KV: P-RLD-MD's worst-gap p99 falls",
                )
            ]
    if view.knob(MODE) == HandoffMode.one_shot.value:
        return [
            view.propose(
                NAME,
                s,
                MODE,
                HandoffMode.one_shot.value,
                HandoffMode.auto.value,
                "one-shot handoffs stall the stream while MD recomputes every relayed token; auto warms MD in a first step while RLD has headroom",
                "the last handoff step is short: P-RLD-MD's worst-gap p99 falls",
            )
        ]
    return []


def propose(view: View) -> list[Proposal]:
    out: list[Proposal] = []
    for s in view.mine(NAME):
        if s.name == RLD_OVERLOAD:
            out += _overload(view, s)
        elif s.name == WAN_DEGRADATION and not any(p.change.target == RELAY_CAP for p in out):
            out += _wan(view, s)
        elif s.name == GAP_BREACH:
            out += _gap(view, s)
        elif s.name == RETURN_TO_INTENT and s.subject.startswith("handoff."):
            out += view.restore(NAME, s, ("relays run as long as configured again", "relays end as configured again: RLD is freed sooner"))
    return out
