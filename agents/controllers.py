"""Deterministic controllers: where a knob should go, and one bounded step towards it.

Every number the agents propose comes from here. Each controller computes a
goal from the figures, then `step_toward` moves at most `max_step`, stays in
bounds, and refuses moves smaller than a deadband (a fraction of the step), so
noise around a goal does not turn into a stream of tiny changes.
"""

from __future__ import annotations

import math

from agents.knobs import limit
from app.config import KnobBounds, PDDConfig, RoleName

#: Moves smaller than this share of max_step are not worth a change.
DEADBAND = 0.1
#: Relay tokens needed to cover a transfer, times this margin (the transfer's tail is longer than p90).
RELAY_MARGIN = 1.5


def step_toward(target: str, current: float | None, goal: float, bounds: KnobBounds) -> float | int | None:
    """The next value on the way from `current` to `goal`; None when already close enough."""
    new = limit(target, current, goal, bounds)
    start = bounds.min if current is None else current
    if current is not None and abs(new - start) < DEADBAND * bounds.max_step:
        return None
    if current is None and goal <= bounds.min:
        return None
    return new


def wan_threshold_goal(intent_ms: float, slowdown: float) -> float:
    """Threshold that keeps P-MD's real WAN wait where the operator meant it.

    The conductor estimates transfers from the configured link model; when the
    real link is `slowdown` times slower, an estimate of T ms really takes
    T x slowdown, so the threshold shrinks by the same factor (more requests
    get a relay to mask the wait). Back at slowdown 1 the goal is the intent.
    """
    return intent_ms / max(1.0, slowdown)


def gap_threshold_ceiling(max_gap_ms: float, error_s: float | None) -> float:
    """The highest `routing.max_wan_transfer_ms` that can keep P-MD's gaps under the target.

    The threshold bounds a turn's predicted gap, and the turn's gap is its prediction plus the
    prediction's error: past the target less a positive mean error, the threshold admits turns
    whose gap is expected over the target.
    """
    return max(0.0, max_gap_ms - max(0.0, error_s or 0.0) * 1000)


def relay_cap_goal(transfer_s: float, tpot_s: float) -> int:
    """Tokens RLD must be allowed to produce while MD waits for the KV (with a margin)."""
    if tpot_s <= 0:
        return 0
    return math.ceil(transfer_s / tpot_s * RELAY_MARGIN)


def lower_by_step(target: str, current: float, bounds: KnobBounds) -> float | int | None:
    """One full step down (shed load), if the floor allows it."""
    return step_toward(target, current, current - bounds.max_step, bounds)


def raise_by_step(target: str, current: float, bounds: KnobBounds) -> float | int | None:
    return step_toward(target, current, current + bounds.max_step, bounds)


def raise_within(target: str, current: float, ceiling: float, bounds: KnobBounds) -> float | int | None:
    """One step up, no further than `ceiling`; None when that is no move (at the ceiling or its bound)."""
    new = step_toward(target, current, min(current + bounds.max_step, ceiling), bounds)
    return new if new is not None and new > current else None


def regressed(before: float | None, after: float | None, tolerance: float, floor: float = 0.5) -> bool:
    """Is the SLO score (worst figure / target) after a change worse than before?

    Worse means higher by more than `tolerance` (relative). Scores below `floor`
    (half the target) count as `floor`: far inside the SLO, noise is not a regression.
    """
    if before is None or after is None:
        return False
    return max(after, floor) > max(before, floor) * (1 + tolerance)


def replica_cost(counts: dict[str, int], cost_per_hour: dict[str, float]) -> float:
    return sum(n * cost_per_hour.get(role, 0.0) for role, n in counts.items())


def fleet_cost(config: PDDConfig, replicas: dict[str, int]) -> float:
    """$/h of the fleet: `replicas` (role name -> count; roles it does not name at their configured count)."""
    present = config.roles.present()
    counts = {role.value: rc.replicas for role, rc in present.items()} | {r: n for r, n in replicas.items() if RoleName(r) in present}
    return replica_cost(counts, {role.value: config.node_groups[rc.node_group].cost_per_hour for role, rc in present.items()})
