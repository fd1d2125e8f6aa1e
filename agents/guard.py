"""Guard: the last check before anything moves. Pure.

A proposal is accepted only when:
- its target is tunable (a numeric knob needs bounds in `agents.bounds`;
  replica counts are bounded by 1..max_replicas), and its old value is still
  the live one (otherwise it is stale);
- its situation has lasted `confirm_ticks` ticks (hysteresis);
- no earlier change is still awaiting verification (one change unit at a time,
  so a regression is attributable and its rollback is exact);
- the target is out of its cooldown, not awaiting a person's approval, and
  not blocked by a recent rollback in the same direction;
- a replica added for a situation has eased it (its figure fell by EASED, or
  the request rate rose by LOAD_GROWN) before another is added for it: more of
  a role that did not help is not tried without end (more main decoders for
  an MD hit gap that comes from elsewhere);
- it moves at most `max_step` and stays within bounds (the value is clamped,
  and a proposal that clamps to no change is refused);
- all accepted knob changes together still form a valid LiveKnobs;
- the replica counts after it do not raise the fleet's cost past
  `agents.max_cost_per_hour`;
- the other proposals of its group (a replica moved between roles) are
  accepted too;
- it belongs to the tick's first situation with an accepted change: the
  changes of one tick are verified, and rolled back, as one unit, so a unit
  holds one situation's changes and a rollback never takes an unrelated
  change with it.
Two proposals for one target in a tick: the more severe one wins.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from agents.controllers import fleet_cost
from agents.knobs import CHOICE_KNOBS, Change, get_knob, is_notice, is_replicas, kind_of, knob_bounds, limit, role_of, with_knobs
from agents.memory import Block, Growth, Memory, growth_key
from agents.proposal import Decision, Proposal, Status
from app.config import AgentsConfig, LiveKnobs, PDDConfig

#: A rolled-back move stays blocked for this many cooldowns, doubled for each rollback of
#: the same move in a row (up to MAX_BLOCK_DOUBLINGS times): otherwise a move that keeps
#: failing, such as shedding a replica the load still needs, returns every few minutes.
BLOCK_COOLDOWNS = 3
MAX_BLOCK_DOUBLINGS = 4

EASED = 0.1
"""A situation's figure fell by this share: the replica added for it helped."""
LOAD_GROWN = 0.2
"""The request rate rose by this share: an unchanged figure does not show the replica futile."""


def _futile(last: Growth, figure: float | None, request_rate: float | None) -> bool:
    if figure is None or figure <= last.figure * (1 - EASED):
        return False
    return request_rate is None or request_rate < last.request_rate * (1 + LOAD_GROWN)


def current_value(target: str, knobs: LiveKnobs, replicas: dict[str, int]) -> Any:
    if is_replicas(target):
        return replicas.get(role_of(target).value)
    return get_knob(knobs, target)


def direction(change: Change) -> int:
    if isinstance(change.new, (int, float)) and not isinstance(change.new, bool) and change.old is not None:
        return (change.new > change.old) - (change.new < change.old)
    return 0


def cooling(target: str, memory: Memory, agents: AgentsConfig, now: float) -> float:
    """Seconds of cooldown left on a target (0 when free)."""
    last = max(memory.last_change.get(target, float("-inf")), memory.noted.get(target, float("-inf")))
    return max(0.0, last + agents.cooldown_s - now)


def _judge(
    p: Proposal, config: PDDConfig, agents: AgentsConfig, knobs: LiveKnobs, replicas: dict[str, int], memory: Memory, now: float, request_rate: float | None
) -> Decision:
    target = p.change.target
    kind = kind_of(target)

    def verdict(status: Status, reason: str = "", change: Change | None = None) -> Decision:
        proposal = p if change is None else p.model_copy(update={"change": change})
        return Decision(proposal=proposal, status=status, reason=reason)

    if p.streak < agents.confirm_ticks:
        return verdict("held", f"confirming: situation seen {p.streak} of {agents.confirm_ticks} ticks")
    left = cooling(target, memory, agents, now)
    if kind == "notice":
        return verdict("held", f"filed {agents.cooldown_s - left:.0f} s ago") if left else verdict("accepted")
    bounds = knob_bounds(agents, config, target)
    if kind == "choice":
        if p.change.new not in CHOICE_KNOBS[target]:
            return verdict("rejected", f"{p.change.new!r} is not one of {CHOICE_KNOBS[target]}")
    elif bounds is None:
        return verdict("rejected", f"{target} has no bounds configured (agents.bounds), so it is not tunable")
    live = current_value(target, knobs, replicas)
    if live != p.change.old:
        return verdict("rejected", f"stale: {target} is {live!r} now, not {p.change.old!r}")
    if memory.units:
        unit = next(iter(memory.units.values()))
        return verdict("held", f"awaiting verification of {unit.id} (due at {unit.verify_at:.0f})")
    if target in memory.pending:
        return verdict("held", f"a proposal from {memory.pending[target]} awaits approval")
    if left:
        return verdict("held", f"cooldown: {left:.0f} s left")
    block = memory.blocked.get(target)
    if block is not None and block.until > now and block.direction in (0, direction(p.change)):
        return verdict("rejected", f"this move was rolled back; blocked for {block.until - now:.0f} s")
    last = memory.growth.get(growth_key(p.situation_key, target))
    if kind == "replicas" and direction(p.change) > 0 and last is not None and _futile(last, p.figure, request_rate):
        return verdict(
            "held",
            f"the replica added for {p.situation_key} {now - last.at:.0f} s ago has not eased it "
            f"(figure {last.figure:.2f} then, {p.figure:.2f} now): another waits until it does",
        )
    if kind == "choice":
        if p.change.new == p.change.old:
            return verdict("rejected", "no change")
        return verdict("accepted")
    assert bounds is not None  # every kind but "choice" (handled above) returned when it had no bounds
    new = limit(target, p.change.old, float(p.change.new), bounds)
    if new == p.change.old:
        return verdict("rejected", "no change within bounds and step")
    change = Change(target=target, old=p.change.old, new=new)
    note = "" if new == p.change.new else f"clamped from {p.change.new!r} to bounds/step"
    return verdict("accepted", note, change)


def _within_budget(d: Decision, config: PDDConfig, agents: AgentsConfig, fleet: dict[str, int]) -> Decision:
    """`d` if the fleet may take its replica change (then `fleet` takes it), else rejected."""
    change = d.proposal.change
    after = {**fleet, role_of(change.target).value: int(change.new)}
    ceiling = agents.max_cost_per_hour
    cost, before = fleet_cost(config, after), fleet_cost(config, fleet)
    if ceiling is not None and cost > ceiling + 1e-9 and cost > before:
        return Decision(proposal=d.proposal, status="rejected", reason=f"over budget: the fleet would cost ${cost:g}/h, ceiling ${ceiling:g}/h")
    fleet.update(after)
    return d


def _together(decisions: list[Decision]) -> list[Decision]:
    """A group's accepted proposals wait while any other of the group is not accepted."""
    blocked = {d.proposal.group: d for d in decisions if d.proposal.group and d.status != "accepted"}
    out = []
    for d in decisions:
        other = blocked.get(d.proposal.group)
        if d.status == "accepted" and other is not None:
            d = Decision(
                proposal=d.proposal, status="held", reason=f"moves together with {other.proposal.change.target}, which is {other.status}: {other.reason}"
            )
        out.append(d)
    return out


def _one_situation(decisions: list[Decision]) -> list[Decision]:
    """Accepted changes of the first situation that has one; the others wait for a later tick."""
    acting = [d for d in decisions if d.status == "accepted" and not is_notice(d.proposal.change.target)]
    if not acting:
        return decisions
    first = acting[0].proposal.situation_key
    later = {id(d) for d in acting if d.proposal.situation_key != first}
    return [
        Decision(proposal=d.proposal, status="held", reason=f"one situation per change unit: {first} goes first") if id(d) in later else d for d in decisions
    ]


def guard(
    proposals: list[Proposal],
    *,
    config: PDDConfig,
    agents: AgentsConfig,
    knobs: LiveKnobs,
    replicas: dict[str, int],
    memory: Memory,
    now: float,
    request_rate: float | None = None,
) -> list[Decision]:
    """A decision for every proposal, most severe first. `request_rate` (requests/s now; None: unknown,
    as for an operator's request) tells a replica that did not help from load that grew past it."""
    decisions: list[Decision] = []
    taken: dict[str, Proposal] = {}
    accepted_knobs: dict[str, Any] = {}
    fleet = dict(replicas)
    for p in sorted(proposals, key=lambda p: -p.severity):
        target = p.change.target
        if target in taken:
            decisions.append(
                Decision(proposal=p, status="rejected", reason=f"{taken[target].specialist} already proposed a change to {target} ({taken[target].situation})")
            )
            continue
        taken[target] = p
        d = _judge(p, config, agents, knobs, replicas, memory, now, request_rate)
        if d.status == "accepted" and kind_of(target) in ("knob", "choice"):
            trial = {**accepted_knobs, target: d.proposal.change.new}
            try:
                with_knobs(knobs, trial)
            except ValidationError as err:
                why = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
                d = Decision(proposal=d.proposal, status="rejected", reason=f"invalid knobs: {why}")
            else:
                accepted_knobs = trial
        elif d.status == "accepted" and kind_of(target) == "replicas":
            d = _within_budget(d, config, agents, fleet)
        decisions.append(d)
    return _one_situation(_together(decisions))


def block_rolled_back(memory: Memory, change: Change, now: float, cooldown_s: float) -> None:
    """After `change` was applied to roll a move back, block that move again for a while. Mutates `memory`."""
    way = direction(change.reverse())
    last = memory.blocked.get(change.target)
    strikes = last.strikes + 1 if last is not None and last.direction == way else 1
    span = BLOCK_COOLDOWNS * cooldown_s * 2 ** min(strikes - 1, MAX_BLOCK_DOUBLINGS)
    memory.blocked[change.target] = Block(until=now + span, direction=way, strikes=strikes)
