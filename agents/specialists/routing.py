"""Routing specialist: the WAN-transfer / hit-rate threshold and the singular filter.

- WAN degradation: the conductor's transfer estimate comes from the configured
  link model, so on a slower WAN the same threshold lets longer real waits
  through P-MD. The threshold shrinks by the observed slowdown (more requests
  get a relay to mask the wait) and returns to the configured intent once the
  link recovers.
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
from agents.controllers import raise_by_step, step_toward, wan_threshold_goal
from agents.proposal import Proposal
from agents.situations import BATHTUB_VALLEY, MD_HIT_BEHIND, RLD_OVERLOAD, WAN_DEGRADATION, WAN_SLOWDOWN, Evidence, Situation
from agents.specialists.base import View

NAME = "routing"
THRESHOLD = "routing.max_wan_transfer_ms"
MIN_HIT = "routing.min_hit_rate"
SINGULAR_MIN_PROMPT = "routing.singular.min_prompt_tokens"
SINGULAR_ENABLED = "routing.singular.enabled"
#: Singular traffic below this share of requests cannot explain MD's cache lag.
SINGULAR_SHARE_MIN = 0.005


def _wan(view: View, situations: list[Situation]) -> list[Proposal]:
    bounds = view.bounds(THRESHOLD)
    if bounds is None:
        return []
    current = view.knob(THRESHOLD)
    intent = view.config.routing.max_wan_transfer_ms
    degraded = [s for s in situations if s.severity > 0]
    if degraded:
        if view.active(RLD_OVERLOAD):
            return []
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
    recovered = situations[0]
    new = step_toward(THRESHOLD, current, intent, bounds)
    if new is None:
        return []
    return [
        view.propose(
            NAME,
            recovered,
            THRESHOLD,
            current,
            new,
            f"WAN back near its model; threshold returns towards the configured {intent:.0f} ms",
            "more high-hit requests take P-MD again, relays are freed",
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
    wan = [s for s in mine if s.name == WAN_DEGRADATION]
    if wan:
        out += _wan(view, wan)
    for s in mine:
        if s.name == MD_HIT_BEHIND:
            out += _singular(view, s)
        elif s.name == BATHTUB_VALLEY:
            out += _valley(view, s)
    return out
