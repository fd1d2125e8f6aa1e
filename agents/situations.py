"""The situations the agents name: their names, the specialists that act on each, the
thresholds that start and end them (hysteresis), and how one is reported (its evidence).

Every situation has an entry threshold and a lower exit threshold: it becomes active
past the first and stays active until the figure falls below the second, so a figure
hovering at a threshold does not flap. Each has a runbook, runbooks/<name>.md.
"""

from __future__ import annotations

from pydantic import BaseModel

RLD_OVERLOAD = "rld_overload"
MD_HIT_BEHIND = "md_hit_behind"
WAN_DEGRADATION = "wan_degradation"
WAN_SATURATED = "wan_saturated"
BATHTUB_VALLEY = "bathtub_valley"
TTFT_BREACH = "ttft_slo_breach"
TPOT_BREACH = "tpot_slo_breach"
GAP_BREACH = "gap_slo_breach"
RELAY_SATURATED = "relay_saturated"
LEASE_LEAK = "kv_lease_leak"
REPLICA_CRASH = "replica_crash"
OVER_PROVISIONED = "over_provisioned"
PREFILL_RELAYING = "prefill_relaying"
RETURN_TO_INTENT = "return_to_intent"

#: Situation -> the specialists that act on it (agents/specialists/).
SPECIALISTS: dict[str, tuple[str, ...]] = {
    RLD_OVERLOAD: ("handoff", "capacity"),
    MD_HIT_BEHIND: ("routing", "capacity"),
    WAN_DEGRADATION: ("routing", "handoff"),
    WAN_SATURATED: ("clerk",),
    BATHTUB_VALLEY: ("routing", "capacity"),
    TTFT_BREACH: ("capacity",),
    TPOT_BREACH: ("capacity",),
    GAP_BREACH: ("routing", "handoff"),
    RELAY_SATURATED: ("routing",),
    LEASE_LEAK: ("clerk",),
    REPLICA_CRASH: ("clerk",),
    OVER_PROVISIONED: ("capacity",),
    PREFILL_RELAYING: ("capacity",),
    RETURN_TO_INTENT: ("routing", "handoff"),
}
SITUATIONS = tuple(SPECIALISTS)

# (enter, stay): a situation starts past `enter` and lasts while past `stay`.
RLD_LOAD = (0.85, 0.7)
"""RLD requests in progress per batch slot."""
RLD_RECOVERED = 0.5
"""Below this RLD load a relay cap lowered under overload goes back up."""
HIT_GAP = (0.15, 0.08)
"""P's prefix-hit ratio minus MD's."""
WAN_SLOWDOWN = (2.0, 1.3)
"""Observed mean pull time / what the configured link model predicts."""
WAN_FAILURES = (0.05, 0.01)
"""Pulls the link broke / pulls."""
LEASES_GONE = (0.05, 0.01)
"""Pulls that found their lease expired (they waited past kv.lease_timeout_s) / pulls:
the harm of a full link (a busy one whose pulls meet their leases is working as meant)."""
VALLEY_SHARE = (0.3, 0.2)
"""Share of MD requests with a prefix hit inside figures.VALLEY."""
VALLEY_GAP = (1.0, 0.8)
"""P-MD worst-gap p99 / the gap target: the valley only matters when it hurts."""
SLO_RATIO = (1.0, 0.85)
"""Figure at the SLO percentile / target."""
MIN_BREACH_REQUESTS = 3
"""Requests over a target in the window without which its percentile is no breach: at a
handful of requests a window's p90 is one slow request, and a replica would be bought for it."""
RELAY_LOAD = (1.0, 0.85)
"""RLD load / `routing.max_relay_load`: at 1 routing already sends requests P-MD for want of a relay."""
GAP_ROOM = (0.5, 0.6)
"""A pipeline's worst-gap p99 / the gap target below which its gaps have room: a relay saturated while
P-MD's gaps sit below this is a threshold set too low (enter below the first, stay below the second),
and a knob returns to its intent in the direction that lengthens the gaps only below the first."""
RELAY_AT_CAP = 0.9
"""Relay tokens p90 / the relay cap at RLD's load from which relays run to their cap (RLD stops
before MD holds the KV, and the stream waits for MD)."""
LEASE_EXCESS = (1.0, 0.8)
"""Live leases / what traffic explains ((requests in the last lease timeout + in flight) x 1.5 + LEASE_SLACK)."""
LEASE_SLACK = 16
OVER_SCORE = (0.5, 0.6)
"""SLO score below which capacity is spare (stays spare below the second)."""
IDLE_LOAD = 0.3
"""A role whose load is below this, with more than one replica, can give one back."""
#: Recovery: a moved knob is restored once its link is back under this slowdown.
RECOVERED_SLOWDOWN = WAN_SLOWDOWN[1]


class Evidence(BaseModel):
    query: str
    """The PromQL that produced the value (or the twin's name for it)."""
    value: float | None
    threshold: float | None = None
    note: str = ""


class Situation(BaseModel):
    name: str
    subject: str = ""
    """What it is about: a link, a deployment; empty for the whole app."""
    summary: str
    severity: int = 1
    """0: asks for no change by itself (a recovery: knobs go back to intent; spare capacity; prefill relaying),
    1: warning, 2: SLO at stake."""
    figure: float | None = None
    """The value its thresholds compare (higher is worse); None where several do."""
    evidence: list[Evidence]
    specialists: list[str]
    streak: int = 1

    @property
    def key(self) -> str:
        return f"{self.name}:{self.subject}" if self.subject else self.name
