"""A cost ceiling for the fleet, replicas moved between roles, one situation per change unit, rollback backoff."""

from __future__ import annotations

import pytest

from agents.controllers import fleet_cost
from agents.guard import BLOCK_COOLDOWNS, guard
from agents.knobs import Change
from agents.memory import Block, Memory
from agents.proposal import Proposal
from agents.situations import Evidence
from agents.twin import TwinAgent
from tests.integration.agents_fixtures import healthy_snapshot, pdd_config
from tests.unit.test_agents_specialists import CASES, propose_all

NOW = 10_000.0
REPLICAS = {"prefill": 1, "relay_decode": 1, "main_decode": 2}
"""Costs $2 + $2 + 2 x $2.5 = $9/h in pdd_config."""
TTFT_BREACH = CASES["ttft_slo_breach"]
MD_IDLE = {"ongoing_by_deployment": {"Prefill": 30.0, "RelayDecode": 20.0, "MainDecode": 10.0}}


def prop(target, old, new, *, group="", severity=2, situation="ttft_slo_breach"):
    return Proposal(
        specialist="capacity",
        situation=situation,
        change=Change(target=target, old=old, new=new),
        reason="test",
        expected_effect="test",
        evidence=[Evidence(query="q", value=1.0)],
        severity=severity,
        streak=3,
        group=group,
    )


def judge(*proposals, memory=None, **agents):
    config = pdd_config(**agents)
    return guard(list(proposals), config=config, agents=config.agents, knobs=config.live_knobs(), replicas=dict(REPLICAS), memory=memory or Memory(), now=NOW)


MOVE = (prop("replicas.main_decode", 2, 1, group="move"), prop("replicas.prefill", 1, 2, group="move"))


def test_fleet_cost_counts_every_role():
    config = pdd_config()
    assert fleet_cost(config, REPLICAS) == 9.0
    assert fleet_cost(config, {"prefill": 3}) == 13.0  # the others at their configured counts


def test_guard_refuses_a_scale_up_past_the_ceiling():
    [d] = judge(prop("replicas.prefill", 1, 2), max_cost_per_hour=10)
    assert d.status == "rejected" and "over budget" in d.reason and "$11/h" in d.reason
    [d] = judge(prop("replicas.prefill", 1, 2), max_cost_per_hour=11)
    assert d.status == "accepted"
    [d] = judge(prop("replicas.main_decode", 2, 1), max_cost_per_hour=5)  # over the ceiling already: shrinking is fine
    assert d.status == "accepted"


def test_a_move_goes_through_within_the_ceiling():
    assert [d.status for d in judge(*MOVE, max_cost_per_hour=9)] == ["accepted", "accepted"]


def test_a_move_waits_while_its_donor_cools_down():
    cooling = Memory(last_change={"replicas.main_decode": NOW - 10})
    down, up = judge(*MOVE, memory=cooling, max_cost_per_hour=9)
    assert down.status == "held" and "cooldown" in down.reason
    assert up.status == "rejected" and "over budget" in up.reason


def test_a_move_waits_while_its_receiver_is_blocked():
    blocked = Memory(blocked={"replicas.prefill": Block(until=NOW + 100, direction=1)})
    down, up = judge(*MOVE, memory=blocked, max_cost_per_hour=9)
    assert up.status == "rejected"
    assert down.status == "held" and "moves together with replicas.prefill" in down.reason


def test_one_situation_per_change_unit():
    threshold = prop("routing.max_wan_transfer_ms", 300.0, 100.0, severity=1, situation="wan_degradation")
    first, second = judge(prop("replicas.prefill", 1, 2), threshold)
    assert first.status == "accepted"
    assert second.status == "held" and "ttft_slo_breach goes first" in second.reason
    [alone] = judge(threshold)
    assert alone.status == "accepted"


def test_capacity_at_the_ceiling_moves_a_replica_from_an_idle_role():
    config = pdd_config(max_cost_per_hour=9)
    snap = healthy_snapshot(**TTFT_BREACH, **MD_IDLE)
    down, up = [p for p in propose_all(snap, config=config) if p.specialist == "capacity"]
    assert (down.change.target, down.change.old, down.change.new) == ("replicas.main_decode", 2, 1)
    assert (up.change.target, up.change.old, up.change.new) == ("replicas.prefill", 1, 2)
    assert down.group == up.group != ""
    assert "ceiling" in up.reason


def test_capacity_at_the_ceiling_without_an_idle_role_leaves_it_to_a_person():
    config = pdd_config(max_cost_per_hour=9)
    proposals = propose_all(healthy_snapshot(**TTFT_BREACH), config=config)
    assert [(p.specialist, p.change.target) for p in proposals] == [("clerk", "notice.ttft_slo_breach")]


def test_capacity_asks_the_twin_which_move_helps():
    config = pdd_config(max_cost_per_hour=9)
    asked = []

    def what_if(config, replicas, knobs, load_rps):
        asked.append(dict(replicas))
        return {"ttft_ms": 500 if replicas["prefill"] > 1 else 4750, "tpot_ms": 20, "gap_ms": 200}

    down, up = [p for p in propose_all(healthy_snapshot(**TTFT_BREACH), config=config, what_if=what_if) if p.specialist == "capacity"]
    assert (down.change.target, up.change.target) == ("replicas.main_decode", "replicas.prefill")
    assert "twin predicts SLO score 0.25" in up.reason
    # +1 of any role passes $9/h and MD is the only role with a replica to spare: two moves, and standing still
    moves = [{"prefill": 2, "relay_decode": 1, "main_decode": 1}, {"prefill": 1, "relay_decode": 2, "main_decode": 1}]
    assert sorted(map(str, asked)) == sorted(map(str, [*moves, REPLICAS]))


def test_capacity_does_not_move_when_the_twin_sees_no_gain():
    config = pdd_config(max_cost_per_hour=9)

    def flat(config, replicas, knobs, load_rps):
        return {"ttft_ms": 4750, "tpot_ms": 20, "gap_ms": 200}

    assert not [p for p in propose_all(healthy_snapshot(**TTFT_BREACH), config=config, what_if=flat) if p.specialist == "capacity"]


@pytest.mark.parametrize(("ttft_at_headroom_ms", "moves"), [(3000, False), (1000, True)])
def test_a_move_for_md_hit_behind_keeps_the_headroom_the_twin_predicts(ttft_at_headroom_ms, moves):
    """MD's hit trails P's and no SLO is breached: one replica of P's would raise MD's hit (the gap
    falls at today's load), but must not leave the fleet worse at 1.25x the load."""
    config = pdd_config(max_cost_per_hour=9)
    snap = healthy_snapshot(prefix_hit_by_role={"prefill": 0.9, "main_decode": 0.6})  # no singular traffic to route elsewhere
    asked = []

    def what_if(config, replicas, knobs, load_rps):
        asked.append(load_rps / snap.request_rate)
        busier = load_rps > snap.request_rate * 1.1
        ttft = 600 if replicas["prefill"] == 2 else (ttft_at_headroom_ms if busier else 800)
        return {"ttft_ms": ttft, "tpot_ms": 20, "gap_ms": 900 if replicas["main_decode"] == 1 else 300}

    # $2 x 2 + $2 + $2.5 = $8.5/h: +1 of any role passes $9/h; P gives one to MD or to RLD
    fleet = {"prefill": 2, "relay_decode": 1, "main_decode": 1}
    got = [p for p in propose_all(snap, config=config, what_if=what_if, replicas=fleet) if p.specialist == "capacity"]
    assert pytest.approx(1.25) in asked
    if moves:
        assert [(p.change.target, p.change.new) for p in got] == [("replicas.prefill", 1), ("replicas.main_decode", 2)]
    else:
        assert got == []


def test_a_move_rolled_back_again_is_blocked_twice_as_long():
    config = pdd_config()
    agent = TwinAgent(config)
    worse = dict(ttft_p=9.0, ttft_p_by_pipeline={"P-MD": 9.0, "P-RLD-MD": 9.0})
    span = BLOCK_COOLDOWNS * config.agents.cooldown_s
    t = NOW
    for strikes in (1, 2):
        assert [c.describe() for c in agent.tick(healthy_snapshot(t, **TTFT_BREACH)).changes] == ["replicas.prefill: 1 -> 2"]
        t += config.agents.verify_after_s + 1
        rolled = agent.tick(healthy_snapshot(t, **worse))
        assert [c.describe() for c in rolled.rollbacks] == ["replicas.prefill: 2 -> 1"]
        block = rolled.memory.blocked["replicas.prefill"]
        assert (block.strikes, block.until) == (strikes, t + span * 2 ** (strikes - 1))
        t = block.until + 1
    agent.tick(healthy_snapshot(t, **TTFT_BREACH))
    kept = agent.tick(healthy_snapshot(t + config.agents.verify_after_s + 1))
    assert [v.outcome for v in kept.verdicts] == ["kept"]
    assert "replicas.prefill" not in kept.memory.blocked
