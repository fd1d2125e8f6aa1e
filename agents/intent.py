"""Knobs back to their intent (the config file's values) once what moved them has cleared.

A situation moves a knob away from the config's value while it lasts. Once no situation that
moves the knob is active, the knob returns towards the config's value, one guarded
step at a time (`return_to_intent`, its subject the knob) -- but only while the figures the
return would push back up have room, so that the return does not bring back what moved the knob:
- the WAN threshold below its intent (lowered for a slow link or for P-MD gaps over the target):
  back up only on a link as configured and with P-MD's gaps under GAP_ROOM of the target;
- the WAN threshold above its intent (raised for a saturated relay): back down only while RLD
  has headroom (more requests take the relay);
- the relay cap below its intent (lowered for an overloaded RLD): back up only while RLD has
  headroom;
- the relay cap above its intent (raised for a slow link or handoff stalls): back down only on
  a link as configured and with P-RLD-MD's gaps under GAP_ROOM of the target.
So a config value that is itself wrong (an operator's mistake in the file) is approached only
as far as the figures allow: the knob stays where its situation has cleared with room to spare.
Every step is also verified, and rolled back if it made the SLO score worse (agents/verify.py).
`handoff.mode` has no step: a return would be the whole switch back, which no headroom judges,
so the mode stays where a situation set it (its runbook says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agents import figures as f
from agents.judge import Judge
from agents.knobs import fmt, get_knob
from agents.situations import (
    GAP_BREACH,
    GAP_ROOM,
    RECOVERED_SLOWDOWN,
    RELAY_SATURATED,
    RETURN_TO_INTENT,
    RLD_OVERLOAD,
    RLD_RECOVERED,
    WAN_DEGRADATION,
    Evidence,
)
from app.config import RoleName

THRESHOLD = "routing.max_wan_transfer_ms"
RELAY_CAP = "handoff.relay_cap_tokens"


@dataclass(frozen=True)
class Room:
    """A figure a return would push up, and the level it must be under."""

    query: str
    value: float | None
    limit: float
    note: str
    unknown_ok: bool
    """Whether a figure without data (no such requests in the window) leaves room."""

    @property
    def ok(self) -> bool:
        return self.unknown_ok if self.value is None else self.value < self.limit

    def describe(self) -> str:
        return f"{self.note}: no data" if self.value is None else f"{self.note} {self.value:.2f} < {self.limit:g}"


def _link(d: Judge) -> Room:
    worst = d.worst_link()  # a link breaking pulls is wan_degradation's, a mover
    value = worst.slowdown if worst is not None else None
    query = d.q("kv_slowdown_mean_by_link") if worst is not None and worst.shared else "observed / expected"
    return Room(query, value, RECOVERED_SLOWDOWN, "worst WAN link's pull time / its model", False)  # no pulls: nothing to judge the link by


def _gap(pipeline: str) -> Callable[[Judge], Room]:
    def room(d: Judge) -> Room:
        ratio = f.gap_ratio(d.snap, d.config.slo, pipeline)
        return Room(d.q("gap_p99_by_pipeline") + " / target", ratio, GAP_ROOM[0], f"{pipeline} worst-gap p99 / the gap target", True)

    return room


def _rld(unknown_ok: bool) -> Callable[[Judge], Room]:
    def room(d: Judge) -> Room:
        load = f.role_load(d.snap, d.config, RoleName.relay_decode)
        return Room("ongoing / (healthy x max_num_seqs)", load, RLD_RECOVERED, "RLD load", unknown_ok)

    return room


@dataclass(frozen=True)
class Side:
    knob: str
    below: bool
    """The knob sits below its intent (the return raises it)."""
    movers: tuple[str, ...]
    """Situations that move the knob (either way): while one is active, it is theirs and stays."""
    rooms: tuple[Callable[[Judge], Room], ...]


THRESHOLD_MOVERS = (WAN_DEGRADATION, GAP_BREACH, RELAY_SATURATED)
RELAY_CAP_MOVERS = (RLD_OVERLOAD, WAN_DEGRADATION, GAP_BREACH)
SIDES = (
    Side(THRESHOLD, True, THRESHOLD_MOVERS, (_link, _gap(f.P_MD))),
    Side(THRESHOLD, False, THRESHOLD_MOVERS, (_rld(True),)),
    Side(RELAY_CAP, True, RELAY_CAP_MOVERS, (_rld(False),)),
    Side(RELAY_CAP, False, RELAY_CAP_MOVERS, (_link, _gap(f.P_RLD_MD))),
)


def returns(d: Judge) -> None:
    """A `return_to_intent` situation for each knob away from the config's value that may go back."""
    intent = d.config.live_knobs()
    for side in SIDES:
        now, goal = get_knob(d.knobs, side.knob), get_knob(intent, side.knob)
        if now is None or goal is None or now == goal or (now < goal) != side.below or d.active(*side.movers):
            continue
        rooms = [room(d) for room in side.rooms]
        if not all(r.ok for r in rooms):
            continue
        d.add(
            RETURN_TO_INTENT,
            f"{side.knob} {fmt(now)}, configured {fmt(goal)}, and what moved it has cleared: it returns towards the configured value "
            f"({'; '.join(r.describe() for r in rooms)})",
            [
                Evidence(query=side.knob, value=now, threshold=goal, note="live value; threshold: the configured one"),
                *(Evidence(query=r.query, value=r.value, threshold=r.limit, note=r.note) for r in rooms),
            ],
            subject=side.knob,
            severity=0,
        )
