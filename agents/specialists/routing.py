"""Routing specialist: the WAN-transfer / hit-rate threshold and the singular filter.

- WAN degradation: the conductor's transfer estimate comes from the configured
  link model, so on a slower WAN the same threshold lets longer real waits
  through P-MD. The threshold shrinks by the observed slowdown (more requests
  get a relay to mask the wait).
- Gap breach on P-MD, on a link that is not degraded: the threshold bounds the
  gap a turn is predicted to cause, and P-MD's gaps are over the target, so the
  threshold is too high for the gap: it comes down one step.
- Relay saturated while P-MD's gaps have room: the threshold is too low; it goes
  up one step, never past the gap target less the gap prediction's mean error
  (a threshold above that admits turns whose gap is expected over the target),
  and may go above the configured value when the gaps allow it.
- Return to intent: once what moved the threshold has cleared, one step back
  towards the configured value (agents/intent.py judges the room for it).
- MD hit falling behind P: requests that end at RLD (the singular filter) leave
  MD's cache behind. When singular traffic is a visible share, the filter gets
  stricter (longer prompts only), and is switched off at its bound.
- Bathtub valley: requests in the middle of the hit range gain least from
  P-MD and pay an unmasked transfer. The hit threshold moves to the valley's
  upper edge so valley requests take the relay: stay away from the valley, do
  not sit in it.

It never pushes more traffic onto a relay decoder that is already overloaded.
"""

from __future__ import annotations

from agents import figures as f
from agents.controllers import gap_threshold_ceiling, lower_by_step, raise_by_step, raise_within, step_toward, wan_threshold_goal
from agents.proposal import Proposal
from agents.situations import (
    BATHTUB_VALLEY,
    GAP_BREACH,
    MD_HIT_BEHIND,
    RELAY_SATURATED,
    RETURN_TO_INTENT,
    RLD_OVERLOAD,
    WAN_DEGRADATION,
    WAN_SLOWDOWN,
    Evidence,
    Situation,
)
from agents.specialists.base import View

NAME = "routing"
THRESHOLD = "routing.max_wan_transfer_ms"
MIN_HIT = "routing.min_hit_rate"
SINGULAR_MIN_PROMPT = "routing.singular.min_prompt_tokens"
SINGULAR_ENABLED = "routing.singular.enabled"
KNOBS = (THRESHOLD, MIN_HIT, SINGULAR_MIN_PROMPT, SINGULAR_ENABLED)
"""The live knobs this specialist moves."""
#: Singular traffic below this share of requests cannot explain MD's cache lag.
SINGULAR_SHARE_MIN = 0.005


def _wan(view: View, degraded: list[Situation]) -> list[Proposal]:
    bounds = view.bounds(THRESHOLD)
    if bounds is None or view.active(RLD_OVERLOAD):
        return []
    current = view.knob(THRESHOLD)
    intent = view.config.routing.max_wan_transfer_ms
    links = {link.link: link for link in f.wan_links(view.snap, view.config)}
    worst, slowdown, why = None, 1.0, ""
    for s in degraded:
        link = links.get(s.subject)
        if link is None:
            continue
        # failing pulls cost a recompute on top of the wait: treat them as a slow link at least
        failing = link.failure_ratio > 0 and link.slowdown < WAN_SLOWDOWN[0]
        effective = WAN_SLOWDOWN[0] if failing else link.slowdown
        if effective > slowdown:
            worst, slowdown = s, effective
            why = (
                f"{link.failure_ratio:.0%} of pulls fail (each costs a recompute): counted as a link {slowdown:.1f}x slow"
                if failing
                else f"pulls run {slowdown:.1f}x the link model"
            )
    if worst is None:
        return []
    goal = wan_threshold_goal(intent, slowdown)
    new = step_toward(THRESHOLD, current, goal, bounds)
    if new is None or new >= current:
        return []
    return [
        view.propose(
            NAME,
            worst,
            THRESHOLD,
            current,
            new,
            f"{why}; threshold goal {goal:.0f} ms (intent {intent:.0f} ms / slowdown)",
            "fewer requests wait on the WAN without a relay: worst-gap p99 and P-MD TTFT-to-second-token fall",
            [Evidence(query="intent / slowdown", value=goal, note="threshold goal, ms")],
        )
    ]


def _gap(view: View, s: Situation) -> list[Proposal]:
    """P-MD's gaps over the target on a link that is not degraded: the threshold is too high for the gap."""
    bounds = view.bounds(THRESHOLD)
    if s.subject != f.P_MD or bounds is None or view.active(RLD_OVERLOAD):
        return []
    current = view.knob(THRESHOLD)
    new = lower_by_step(THRESHOLD, current, bounds)
    if new is None or new >= current:
        return []
    return [
        view.propose(
            NAME,
            s,
            THRESHOLD,
            current,
            new,
            f"P-MD's gaps are over the {view.config.slo.max_gap_ms:.0f} ms target on a link that is not degraded: "
            f"the threshold on the predicted gap comes down one step",
            "turns predicted to stall longest take the relay instead of P-MD: P-MD's worst-gap p99 falls",
        )
    ]


def _relay_saturated(view: View, s: Situation) -> list[Proposal]:
    """The relay at its limit while P-MD's gaps have room: the threshold is too low."""
    bounds = view.bounds(THRESHOLD)
    if bounds is None:
        return []
    current = view.knob(THRESHOLD)
    ceiling = gap_threshold_ceiling(view.config.slo.max_gap_ms, f.gap_error_s(view.snap))
    new = raise_within(THRESHOLD, current, ceiling, bounds)
    if new is None:
        return []
    return [
        view.propose(
            NAME,
            s,
            THRESHOLD,
            current,
            new,
            f"the relay is saturated while P-MD's gaps have room: the threshold on the predicted gap goes up one step "
            f"(at most {ceiling:.0f} ms, the gap target less the prediction's mean error)",
            "the turns predicted to stall least take P-MD instead of waiting for a relay: RLD load falls, P-MD's gaps stay under the target",
            [Evidence(query="slo.max_gap_ms - max(0, gap prediction error)", value=ceiling, note="threshold ceiling, ms")],
        )
    ]


def _singular(view: View, s: Situation) -> list[Proposal]:
    share = f.singular_share(view.snap)
    if share is None or share < SINGULAR_SHARE_MIN or not view.knob(SINGULAR_ENABLED):
        return []
    evidence = [Evidence(query="singular_rate / request rate", value=share, threshold=SINGULAR_SHARE_MIN, note="singular share")]
    effect = "fewer requests end at RLD, MD's prefix cache catches up with P's"
    bounds = view.bounds(SINGULAR_MIN_PROMPT)
    current = view.knob(SINGULAR_MIN_PROMPT)
    if bounds is not None:
        new = raise_by_step(SINGULAR_MIN_PROMPT, current, bounds)
        if new is not None and new > current:
            return [
                view.propose(
                    NAME,
                    s,
                    SINGULAR_MIN_PROMPT,
                    current,
                    new,
                    f"singular requests are {share:.1%} of traffic; only longer prompts may end at RLD",
                    effect,
                    evidence,
                )
            ]
    return [
        view.propose(
            NAME, s, SINGULAR_ENABLED, True, False, f"singular requests are {share:.1%} of traffic and the prompt floor is at its bound", effect, evidence
        )
    ]


def _valley(view: View, s: Situation) -> list[Proposal]:
    if view.active(RLD_OVERLOAD):
        return []
    bounds = view.bounds(MIN_HIT)
    if bounds is None:
        return []
    current = view.knob(MIN_HIT)
    new = step_toward(MIN_HIT, current, f.VALLEY[1], bounds)
    if new is None or (current is not None and new <= current):
        return []
    return [
        view.propose(
            NAME,
            s,
            MIN_HIT,
            current,
            new,
            f"P-MD needs MD hit >= {f.VALLEY[1]:.0%} (the valley's upper edge); valley requests take the relay",
            "valley requests stop paying an unmasked transfer: P-MD worst-gap p99 falls",
        )
    ]


def propose(view: View) -> list[Proposal]:
    mine = view.mine(NAME)
    out: list[Proposal] = []
    wan = [s for s in mine if s.name == WAN_DEGRADATION and s.severity > 0]
    if wan:
        out += _wan(view, wan)
    for s in mine:
        if s.name == MD_HIT_BEHIND:
            out += _singular(view, s)
        elif s.name == BATHTUB_VALLEY:
            out += _valley(view, s)
        elif s.name == GAP_BREACH:
            out += _gap(view, s)
        elif s.name == RELAY_SATURATED:
            out += _relay_saturated(view, s)
        elif s.name == RETURN_TO_INTENT and s.subject.startswith("routing."):
            out += view.restore(NAME, s, ("more requests take P-MD again, relays are freed", "more requests take the relay again, as configured"))
    return out
