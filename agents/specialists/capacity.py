"""Capacity specialist: P:RLD:MD replica counts, one replica at a time, cost-aware.

Which role a situation asks for:
- TTFT breach: prefill (TTFT is P's queue plus prefill);
- TPOT breach: main decode, or relay decode when relayed requests are the slow
  ones and RLD is busy;
- RLD overload: relay decode;
- MD hit behind P, when singular traffic does not explain it: main decode
  (more prefix cache);
- bathtub valley, once the routing threshold already sits at the valley's
  edge: main decode (more cache raises hits out of the valley);
- over-provisioned: the most expensive idle role gives one replica back.

With the digital twin's what-if (agents/whatif.py), a scale-up considers +1 on
every role that may grow and takes the cheapest plan predicted to meet the SLO
(the best predicted one when none does); a scale-down happens only when the
twin predicts the SLO still holds with margin. Roles whose replicas are
crashing are left alone: their healthy count says nothing about load.
"""

from __future__ import annotations

from agents import figures as f
from agents.diagnose import (
    BATHTUB_VALLEY,
    IDLE_LOAD,
    MD_HIT_BEHIND,
    OVER_PROVISIONED,
    REPLICA_CRASH,
    RLD_LOAD,
    RLD_OVERLOAD,
    TPOT_BREACH,
    TTFT_BREACH,
    Evidence,
    Situation,
)
from agents.knobs import replica_target
from agents.proposal import Proposal
from agents.specialists.base import View
from agents.specialists.routing import MIN_HIT, SINGULAR_SHARE_MIN
from agents.whatif import predict
from app.config import RoleName

NAME = "capacity"
#: A scale-down must leave the predicted SLO score at or below this.
DOWN_MARGIN = 0.8


def _cost(view: View, role: RoleName) -> float:
    rc = view.config.roles.get(role)
    return view.config.node_groups[rc.node_group].cost_per_hour if rc else 0.0


def _frozen(view: View) -> set[RoleName]:
    crashing = {s.subject for s in view.situations if s.name == REPLICA_CRASH}
    return {r for r in view.config.roles.present() if f.deployment(r) in crashing}


def _role_for(view: View, s: Situation) -> RoleName | None:
    if s.name == TTFT_BREACH:
        return RoleName.prefill
    if s.name == RLD_OVERLOAD:
        return RoleName.relay_decode
    if s.name == TPOT_BREACH:
        rld = f.role_load(view.snap, view.config, RoleName.relay_decode)
        if f.worst_tpot_pipeline(view.snap) == f.P_RLD_MD and rld is not None and rld >= RLD_LOAD[1]:
            return RoleName.relay_decode
        return RoleName.main_decode
    if s.name == MD_HIT_BEHIND:
        share = f.singular_share(view.snap)
        return RoleName.main_decode if share is None or share < SINGULAR_SHARE_MIN else None
    if s.name == BATHTUB_VALLEY:
        at_edge = (view.knob(MIN_HIT) or 0.0) >= f.VALLEY[1] - 1e-9
        return RoleName.main_decode if at_edge else None
    return None


def _can_grow(view: View, role: RoleName, frozen: set[RoleName]) -> bool:
    rc = view.config.roles.get(role)
    return rc is not None and role not in frozen and view.replicas.get(role.value, rc.replicas) < rc.max_replicas


def _plan(view: View, role: RoleName, delta: int) -> dict[str, int]:
    plan = dict(view.replicas)
    plan[role.value] = plan.get(role.value, 0) + delta
    return plan


def _twin_pick(view: View, candidates: list[RoleName]) -> tuple[RoleName, str] | None:
    """Cheapest candidate the twin predicts to meet the SLO, else the best predicted."""
    scored = []
    for role in candidates:
        try:
            pred = predict(view.what_if, view.config, _plan(view, role, +1), view.knobs, view.snap.request_rate)
        except Exception:  # a twin failure must not stop the rule-based answer
            return None
        scored.append((pred.score(view.config), _cost(view, role), role))
    meeting = [x for x in scored if x[0] <= 1.0]
    score, cost, role = min(meeting, key=lambda x: (x[1], x[0])) if meeting else min(scored, key=lambda x: (x[0], x[1]))
    return role, f"twin predicts SLO score {score:.2f} with one more {role.value} replica (${cost:g}/h)"


def _up(view: View, s: Situation, role: RoleName, frozen: set[RoleName]) -> Proposal | None:
    note = f"{s.summary}: one more {role.value} replica"
    if view.what_if is not None:
        candidates = [r for r in view.config.roles.present() if _can_grow(view, r, frozen)]
        picked = _twin_pick(view, candidates) if candidates else None
        if picked is not None:
            role, note = picked
    if not _can_grow(view, role, frozen):
        return None
    target = replica_target(role)
    now = view.replicas.get(role.value, view.config.roles.get(role).replicas)
    return view.propose(
        NAME, s, target, now, now + 1, note,
        f"{role.value} capacity +1 (${_cost(view, role):g}/h): {s.name.replace('_', ' ')} eases",
        [Evidence(query="cost_per_hour", value=_cost(view, role), note=role.value)],
    )


def _down(view: View, s: Situation, frozen: set[RoleName]) -> Proposal | None:
    idle = []
    for role in view.config.roles.present():
        n = view.replicas.get(role.value, 0)
        load = f.role_load(view.snap, view.config, role)
        if role not in frozen and n > 1 and load is not None and load < IDLE_LOAD:
            idle.append((-_cost(view, role), load, role))
    if not idle:
        return None
    _, load, role = min(idle, key=lambda x: (x[0], x[1]))
    note = f"{role.value} at {load:.0%} load; the costliest idle role gives one replica back"
    if view.what_if is not None:
        try:
            pred = predict(view.what_if, view.config, _plan(view, role, -1), view.knobs, view.snap.request_rate)
        except Exception:  # keep capacity: without a prediction, scaling down is not proven safe
            return None
        if pred.score(view.config) > DOWN_MARGIN:
            return None
        note += f"; twin predicts SLO score {pred.score(view.config):.2f}"
    target = replica_target(role)
    n = view.replicas[role.value]
    return view.propose(NAME, s, target, n, n - 1, note, f"saves ${_cost(view, role):g}/h with the SLO still met")


def propose(view: View) -> list[Proposal]:
    """At most one replica change per tick, for the most severe situation that asks for one."""
    frozen = _frozen(view)
    for s in sorted(view.mine(NAME), key=lambda s: -s.severity):
        if s.name == OVER_PROVISIONED:
            p = _down(view, s, frozen)
        elif s.severity == 0:  # a recovery: the knobs go back, capacity stays
            continue
        else:
            role = _role_for(view, s)
            p = _up(view, s, role, frozen) if role is not None else None
        if p is not None:
            return [p]
    return []
