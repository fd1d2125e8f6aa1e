"""Capacity specialist: P:RLD:MD replica counts, one replica at a time, cost-aware.

Which role a situation asks for:
- TTFT breach: prefill (TTFT is P's queue plus prefill); none for a breach
  that began while prefill relays for want of a live relay decoder (P-P-MD,
  or the window still holds such requests): P's time then goes to decoding
  them too, which the relay's replacement ends, and a notice says so. A
  breach seen before that is load, and grows prefill as usual;
- TPOT breach: main decode, or relay decode when relayed requests (P-RLD-MD,
  P-RLD, P-P-MD) are the slow ones and RLD is busy; neither when only relayed
  requests are slow and both decoders are idle (a notice says why: the
  relay's pull and the handoff);
- RLD overload: relay decode;
- MD hit behind P, when singular traffic does not explain it: main decode
  (more prefix cache);
- bathtub valley, once the routing threshold already sits at the valley's
  edge: main decode (more cache raises hits out of the valley);
- over-provisioned: the most expensive idle role gives one replica back.

Under a cost ceiling (`agents.max_cost_per_hour`) a role that must grow
past it gets a replica moved from another role instead: the two changes go
through the guard, and are verified and rolled back, together. Without the
twin the donor is the least loaded idle role; with no idle role nothing moves.

With the digital twin's what-if (agents/whatif.py), a scale-up considers one
more replica of every role that may grow (+1 within the ceiling, else each
move that funds it) and takes the cheapest plan predicted to meet the SLO (the
best predicted one when none does; a move only when the twin predicts it
better than standing still, and, for a situation that breaches no SLO (MD's
hit behind, the bathtub valley), no worse at `HEADROOM` times today's load:
such a move trades capacity for a better hit, and must not spend the margin
the fleet keeps for growth). A scale-down happens only when the twin predicts
the SLO still holds with margin. A twin that predicts the current fleet meets
the SLO while the cluster breaches it does not reproduce the situation (sessions
held back by a breach send fewer requests, so the measured rate understates
demand) and cannot rank plans against it: the rule decides. Roles whose
replicas are crashing are left alone: their healthy count says nothing about
load.
"""

from __future__ import annotations

from agents import figures as f
from agents.controllers import fleet_cost
from agents.knobs import notice_target, replica_target
from agents.proposal import Proposal
from agents.situations import (
    BATHTUB_VALLEY,
    GAP_BREACH,
    IDLE_LOAD,
    MD_HIT_BEHIND,
    OVER_PROVISIONED,
    PREFILL_RELAYING,
    REPLICA_CRASH,
    RLD_LOAD,
    RLD_OVERLOAD,
    TPOT_BREACH,
    TTFT_BREACH,
    Evidence,
    Situation,
)
from agents.specialists.base import View
from agents.specialists.routing import MIN_HIT, SINGULAR_SHARE_MIN
from agents.whatif import predict
from app.config import RoleConfig, RoleName

NAME = "capacity"
#: A scale-down must leave the predicted SLO score at or below this.
DOWN_MARGIN = 0.8
#: A decoder this loaded (requests per batch slot) counts as busy: RLD overload's exit threshold.
DECODER_BUSY = RLD_LOAD[1]
#: The load, against today's, at which a move for a situation that breaches no SLO must not predict worse.
HEADROOM = 1.25
SLO_BREACHES = (TTFT_BREACH, TPOT_BREACH, GAP_BREACH)


def _role_config(view: View, role: RoleName) -> RoleConfig:
    """A configured role's config (plans hold only roles.present() ones); KeyError, as PDDConfig.datacenter_of, otherwise."""
    rc = view.config.roles.get(role)
    if rc is None:
        raise KeyError(role)
    return rc


def _cost(view: View, role: RoleName) -> float:
    rc = view.config.roles.get(role)
    return view.config.node_groups[rc.node_group].cost_per_hour if rc else 0.0


def _frozen(view: View) -> set[RoleName]:
    crashing = {s.subject for s in view.situations if s.name == REPLICA_CRASH}
    return {r for r in view.config.roles.present() if f.deployment(r) in crashing}


def _role_for(view: View, s: Situation) -> RoleName | None:
    if s.name == TTFT_BREACH:
        return None if _began_while_prefill_relays(view, s) else RoleName.prefill
    if s.name == RLD_OVERLOAD:
        return RoleName.relay_decode
    if s.name == TPOT_BREACH:
        return _decoder_for_tpot(view)
    if s.name == MD_HIT_BEHIND:
        share = f.singular_share(view.snap)
        return RoleName.main_decode if share is None or share < SINGULAR_SHARE_MIN else None
    if s.name == BATHTUB_VALLEY:
        at_edge = (view.knob(MIN_HIT) or 0.0) >= f.VALLEY[1] - 1e-9
        return RoleName.main_decode if at_edge else None
    return None


def _busy(view: View, role: RoleName) -> bool:
    load = f.role_load(view.snap, view.config, role)
    return load is not None and load >= DECODER_BUSY


def _decoder_for_tpot(view: View) -> RoleName | None:
    """The decoder a TPOT breach asks for. None when only relayed requests (f.RELAYED) are slow
    while MD's own (P-MD) meet the target and neither decoder is busy: a relayed request's tokens
    also wait for the relay's KV pull after the first token and for the handoff, which another
    replica would not shorten (short relayed requests breach this way on an idle cluster)."""
    if f.worst_tpot_pipeline(view.snap) not in f.RELAYED:
        return RoleName.main_decode
    if _busy(view, RoleName.relay_decode):
        return RoleName.relay_decode
    md_tpot = view.snap.tpot_p_by_pipeline.get(f.P_MD)
    if _busy(view, RoleName.main_decode) or (md_tpot is not None and md_tpot * 1000 >= view.config.slo.tpot_ms):
        return RoleName.main_decode
    return None


def _relayed_tpot_notice(view: View, s: Situation) -> Proposal:
    per = view.snap.tpot_p_by_pipeline
    worst = f.worst_tpot_pipeline(view.snap)
    assert worst is not None  # only for a breach whose worst pipeline is a relayed one (_decoder_for_tpot)
    md = per.get(f.P_MD)
    md_text = f"P-MD {md * 1000:.0f} ms" if md is not None else "no P-MD requests"
    return view.propose(
        NAME,
        s,
        notice_target(s.key),
        None,
        s.summary,
        f"only relayed requests are slow ({worst} {per[worst] * 1000:.0f} ms, {md_text}) and neither decoder is busy: "
        "their tokens wait for the relay's KV pull and the handoff, which a replica more would not shorten; a person checks",
        "a person follows runbooks/" + s.name + ".md",
    )


def _prefill_relaying(view: View) -> Situation | None:
    return next((r for r in view.situations if r.name == PREFILL_RELAYING), None)


def _began_while_prefill_relays(view: View, s: Situation) -> bool:
    """Whether breach `s` has lasted no longer than prefill has been relaying: a breach that was there before is load."""
    relaying = _prefill_relaying(view)
    return relaying is not None and s.streak <= relaying.streak


def _relay_outage_ttft_notice(view: View, s: Situation) -> Proposal:
    relaying = _prefill_relaying(view)
    assert relaying is not None  # only for a breach that began while prefill relays (_role_for)
    return view.propose(
        NAME,
        s,
        notice_target(s.key),
        None,
        s.summary,
        f"{relaying.summary}; the breach began since ({s.streak} of {relaying.streak} ticks): prefill decodes beside its "
        "prompts, so this TTFT does not measure prefill capacity; the relay's replacement ends it, and the breach is "
        f"judged again once prefill no longer relays and the window holds no {f.P_P_MD} request; a person checks",
        "a person follows runbooks/" + s.name + ".md and runbooks/" + PREFILL_RELAYING + ".md",
        relaying.evidence,
    )


def _can_grow(view: View, role: RoleName, frozen: set[RoleName]) -> bool:
    rc = view.config.roles.get(role)
    return rc is not None and role not in frozen and view.replicas.get(role.value, rc.replicas) < rc.max_replicas


Plan = tuple[tuple[RoleName, int], ...]
"""Replica changes made together: (role, +1 or -1) each."""


def _fleet(view: View, plan: Plan) -> dict[str, int]:
    fleet = dict(view.replicas)
    for role, delta in plan:
        fleet[role.value] = fleet.get(role.value, _role_config(view, role).replicas) + delta
    return fleet


def _plan_cost(view: View, plan: Plan) -> float:
    return sum(delta * _cost(view, role) for role, delta in plan)


def _fits(view: View, plan: Plan) -> bool:
    ceiling = view.agents.max_cost_per_hour
    return ceiling is None or fleet_cost(view.config, _fleet(view, plan)) <= ceiling + 1e-9


def _grow(view: View, role: RoleName, frozen: set[RoleName]) -> list[Plan]:
    """Ways to one more `role` replica within the ceiling: +1, else one replica moved from each possible donor."""
    if not _can_grow(view, role, frozen):
        return []
    up: Plan = ((role, +1),)
    if _fits(view, up):
        return [up]
    donors = [d for d in view.config.roles.present() if d != role and d not in frozen and view.replicas.get(d.value, 0) > 1]
    return [plan for plan in (((d, -1), (role, +1)) for d in donors) if _fits(view, plan)]


def _describe(plan: Plan) -> str:
    return ", ".join(f"{'+' if delta > 0 else '-'}1 {role.value}" for role, delta in plan)


def _twin_pick(view: View, s: Situation, frozen: set[RoleName]) -> tuple[Plan, str] | None:
    """Cheapest plan the twin predicts to meet the SLO, else the best predicted; a move only if it beats standing still
    (and, for `s` breaching no SLO, keeps the headroom). None (the rule decides) when the twin fails, or predicts
    the SLO met where the cluster breaches it."""
    what_if = view.what_if
    if what_if is None:
        return None
    plans = [plan for role in view.config.roles.present() for plan in _grow(view, role, frozen)]
    if not plans:
        return None

    def score(fleet: dict[str, int], load: float = 1.0) -> float:
        return predict(what_if, view.config, fleet, view.knobs, view.snap.request_rate * load).score(view.config)

    try:
        still = score(dict(view.replicas))
        observed = f.slo_score(f.slo_figures(view.snap, view.config.slo))
        if observed is not None and observed > 1.0 and still <= 1.0:
            return None
        # a move (a replica taken from another role) only where it beats standing still
        scored = [x for x in ((score(_fleet(view, plan)), _plan_cost(view, plan), plan) for plan in plans) if len(x[2]) == 1 or x[0] < still]
        if not scored:
            return (), f"twin predicts no replica move within the ${view.agents.max_cost_per_hour:g}/h ceiling beats SLO score {still:.2f}"
        meeting = [x for x in scored if x[0] <= 1.0]
        best, cost, plan = min(meeting, key=lambda x: (x[1], x[0])) if meeting else min(scored, key=lambda x: (x[0], x[1]))
        if len(plan) > 1 and s.name not in SLO_BREACHES:
            kept, moved = score(dict(view.replicas), HEADROOM), score(_fleet(view, plan), HEADROOM)
            if moved > kept:
                return (), f"twin predicts {_describe(plan)} would cost headroom: SLO score {kept:.2f} -> {moved:.2f} at {HEADROOM:g}x today's load"
    except Exception:  # a twin failure must not stop the rule-based answer
        return None
    return plan, f"twin predicts SLO score {best:.2f} after {_describe(plan)} (${cost:+g}/h)"


def _rule_pick(view: View, role: RoleName, frozen: set[RoleName]) -> tuple[Plan, str] | None:
    """One more `role` replica; at the ceiling, moved from the least loaded idle role."""
    plans = _grow(view, role, frozen)
    if len(plans) == 1 and len(plans[0]) == 1:
        return plans[0], f"one more {role.value} replica"
    idle = []
    for plan in plans:
        donor = plan[0][0]
        load = f.role_load(view.snap, view.config, donor)
        if load is not None and load < IDLE_LOAD:
            idle.append((load, plan))
    if not idle:
        return None
    load, plan = min(idle, key=lambda x: x[0])
    return plan, f"at the ${view.agents.max_cost_per_hour:g}/h ceiling: {plan[0][0].value} ({load:.0%} busy) gives one replica to {role.value}"


def _up(view: View, s: Situation, role: RoleName, frozen: set[RoleName]) -> list[Proposal]:
    picked = _twin_pick(view, s, frozen) if view.what_if is not None else None
    if picked is None:
        picked = _rule_pick(view, role, frozen)
    if picked is None or not picked[0]:
        return []
    plan, note = picked
    group = f"move:{plan[0][0].value}->{plan[-1][0].value}" if len(plan) > 1 else ""
    out = []
    for r, delta in plan:
        now = view.replicas.get(r.value, _role_config(view, r).replicas)
        if delta > 0:
            effect = f"{r.value} capacity +1 (${_cost(view, r):g}/h): {s.name.replace('_', ' ')} eases"
        else:
            effect = f"{r.value} capacity -1 (${_cost(view, r):g}/h) pays for it"
        p = view.propose(
            NAME,
            s,
            replica_target(r),
            now,
            now + delta,
            f"{s.summary}: {note}",
            effect,
            [Evidence(query="cost_per_hour", value=_cost(view, r), note=r.value)],
        )
        out.append(p.model_copy(update={"group": group}))
    return out


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
            pred = predict(view.what_if, view.config, _fleet(view, ((role, -1),)), view.knobs, view.snap.request_rate)
        except ValueError:  # the twin cannot model this config (no accelerator figures): the rules decide
            pred = None
        except Exception:  # keep capacity: a twin that failed has not proven scaling down safe
            return None
        if pred is not None and pred.score(view.config) > DOWN_MARGIN:
            return None
        if pred is not None:
            note += f"; twin predicts SLO score {pred.score(view.config):.2f}"
    target = replica_target(role)
    n = view.replicas[role.value]
    return view.propose(NAME, s, target, n, n - 1, note, f"saves ${_cost(view, role):g}/h with the SLO still met")


def propose(view: View) -> list[Proposal]:
    """At most one replica plan per tick (one change, or one move), for the most severe situation that asks for one;
    and a notice for a TPOT or TTFT breach no replica would ease."""
    frozen = _frozen(view)
    notices = []
    for s in sorted(view.mine(NAME), key=lambda s: -s.severity):
        if s.name == OVER_PROVISIONED:
            down = _down(view, s, frozen)
            plan = [down] if down is not None else []
        elif s.severity == 0:  # asks for no replica by itself (prefill relaying)
            continue
        else:
            role = _role_for(view, s)
            plan = _up(view, s, role, frozen) if role is not None else []
            if role is None and s.name == TPOT_BREACH:
                notices.append(_relayed_tpot_notice(view, s))
            elif role is None and s.name == TTFT_BREACH:
                notices.append(_relay_outage_ttft_notice(view, s))
        if plan:
            return notices + plan
    return notices
