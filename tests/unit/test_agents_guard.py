"""The guard: bounds, step size, cooldown, hysteresis, one unit at a time, rollback blocks."""

from __future__ import annotations

import pytest

from agents.guard import guard
from agents.knobs import Change
from agents.memory import Block, Growth, Memory, Unit, growth_key
from agents.proposal import Proposal
from agents.situations import Evidence
from tests.integration.agents_fixtures import pdd_config

NOW = 10_000.0
REPLICAS = {"prefill": 1, "relay_decode": 1, "main_decode": 2}


def prop(target, old, new, *, streak=1, severity=1, specialist="routing", situation="wan_degradation", figure=None):
    return Proposal(
        specialist=specialist,
        situation=situation,
        change=Change(target=target, old=old, new=new),
        reason="test",
        expected_effect="test",
        evidence=[Evidence(query="q", value=1.0)],
        severity=severity,
        streak=streak,
        figure=figure,
    )


def judge(*proposals, memory=None, replicas=None, request_rate=None, **agents):
    config = pdd_config(**agents)
    return guard(
        list(proposals),
        config=config,
        agents=config.agents,
        knobs=config.live_knobs(),
        replicas=dict(replicas or REPLICAS),
        memory=memory or Memory(),
        now=NOW,
        request_rate=request_rate,
    )


def test_accepts_a_sound_change():
    [d] = judge(prop("routing.max_wan_transfer_ms", 300.0, 100.0))
    assert d.status == "accepted" and d.proposal.change.new == 100.0


def test_clamps_to_step_and_bounds():
    [d] = judge(prop("routing.max_wan_transfer_ms", 300.0, -50.0))
    assert d.status == "accepted" and d.proposal.change.new == 100.0 and "clamped" in d.reason
    [d] = judge(prop("replicas.relay_decode", 1, 7))
    assert d.proposal.change.new == 2


def test_refuses_a_change_that_clamps_to_nothing():
    [d] = judge(prop("replicas.relay_decode", 3, 4), replicas={**REPLICAS, "relay_decode": 3})
    assert d.status == "rejected"


def test_knob_without_bounds_is_not_tunable():
    [d] = judge(prop("routing.max_relay_load", 0.9, 0.8))
    assert d.status == "rejected" and "no bounds" in d.reason


def test_choice_knob_values_are_checked():
    [d] = judge(prop("handoff.mode", "auto", "sideways"))
    assert d.status == "rejected"
    [d] = judge(prop("handoff.mode", "auto", "one_shot"))
    assert d.status == "accepted"


def test_stale_proposal_is_refused():
    [d] = judge(prop("routing.max_wan_transfer_ms", 250.0, 100.0))
    assert d.status == "rejected" and "stale" in d.reason


def test_waits_for_confirmation_ticks():
    [d] = judge(prop("routing.max_wan_transfer_ms", 300.0, 100.0, streak=1), confirm_ticks=2)
    assert d.status == "held" and "confirming" in d.reason
    [d] = judge(prop("routing.max_wan_transfer_ms", 300.0, 100.0, streak=2), confirm_ticks=2)
    assert d.status == "accepted"


def test_cooldown_counts_from_the_last_change_and_from_filed_proposals():
    target = "routing.max_wan_transfer_ms"
    [d] = judge(prop(target, 300.0, 100.0), memory=Memory(last_change={target: NOW - 30}))
    assert d.status == "held" and "cooldown" in d.reason
    [d] = judge(prop(target, 300.0, 100.0), memory=Memory(noted={target: NOW - 30}))
    assert d.status == "held"
    [d] = judge(prop(target, 300.0, 100.0), memory=Memory(last_change={target: NOW - 61}))
    assert d.status == "accepted"


def test_one_unit_at_a_time():
    unit = Unit(id="t/unit", tick="t", applied_at=NOW - 5, verify_at=NOW + 25, changes=[], baseline={})
    [d] = judge(prop("replicas.prefill", 1, 2), memory=Memory(units={unit.id: unit}))
    assert d.status == "held" and "verification" in d.reason


def test_pending_approval_holds_the_target():
    [d] = judge(prop("replicas.prefill", 1, 2), memory=Memory(pending={"replicas.prefill": "tick-x"}))
    assert d.status == "held" and "tick-x" in d.reason


def test_rolled_back_move_is_blocked_in_that_direction_only():
    memory = Memory(blocked={"replicas.main_decode": Block(until=NOW + 100, direction=-1)})
    [d] = judge(prop("replicas.main_decode", 2, 1), memory=memory)
    assert d.status == "rejected" and "rolled back" in d.reason
    [d] = judge(prop("replicas.main_decode", 2, 3), memory=memory)
    assert d.status == "accepted"


GREW_FOR_HIT_GAP = Memory(
    growth={
        growth_key("md_hit_behind", "replicas.main_decode"): Growth(
            situation="md_hit_behind", target="replicas.main_decode", at=NOW - 600, figure=0.3, request_rate=5.0
        )
    }
)


@pytest.mark.parametrize(
    "figure,request_rate,status",
    [
        (0.3, 5.0, "held"),  # the last replica did not narrow the gap
        (0.35, None, "held"),  # nor is the load known to have grown
        (0.26, 5.0, "accepted"),  # it narrowed the gap by more than EASED
        (0.3, 6.5, "accepted"),  # the load grew past it
    ],
)
def test_another_replica_for_a_situation_waits_until_the_last_one_eased_it(figure, request_rate, status):
    grow = prop("replicas.main_decode", 2, 3, specialist="capacity", situation="md_hit_behind", figure=figure)
    [d] = judge(grow, memory=GREW_FOR_HIT_GAP, request_rate=request_rate)
    assert d.status == status
    if status == "held":
        assert "has not eased it" in d.reason and "0.30 then" in d.reason


def test_a_replica_that_did_not_ease_one_situation_may_grow_for_another_or_shrink():
    other = prop("replicas.main_decode", 2, 3, specialist="capacity", situation="tpot_slo_breach", figure=1.4)
    assert [d.status for d in judge(other, memory=GREW_FOR_HIT_GAP, request_rate=5.0)] == ["accepted"]
    down = prop("replicas.main_decode", 2, 1, specialist="capacity", situation="md_hit_behind", figure=0.3)
    assert [d.status for d in judge(down, memory=GREW_FOR_HIT_GAP, request_rate=5.0)] == ["accepted"]


def test_conflict_the_more_severe_wins():
    low = prop("handoff.relay_cap_tokens", 512, 768, severity=1, specialist="handoff")
    high = prop("handoff.relay_cap_tokens", 512, 256, severity=2, specialist="handoff", situation="rld_overload")
    decisions = judge(low, high)
    assert [(d.proposal.change.new, d.status) for d in decisions] == [(256, "accepted"), (768, "rejected")]


def test_combined_knobs_must_validate():
    config = pdd_config()
    knobs = config.live_knobs().model_copy(update={"handoff": config.handoff.model_copy(update={"min_relay_cap_tokens": 300})})
    d = guard(
        [prop("handoff.relay_cap_tokens", 512, 256, specialist="handoff")],
        config=config,
        agents=config.agents,
        knobs=knobs,
        replicas=REPLICAS,
        memory=Memory(),
        now=NOW,
    )
    assert d[0].status == "rejected" and "invalid knobs" in d[0].reason


@pytest.mark.parametrize("filed_ago,status", [(10, "held"), (100, "accepted")])
def test_notices_are_throttled_by_the_cooldown(filed_ago, status):
    target = "notice.kv_lease_leak"
    [d] = judge(prop(target, None, "leak", specialist="clerk", situation="kv_lease_leak"), memory=Memory(noted={target: NOW - filed_ago}))
    assert d.status == status
