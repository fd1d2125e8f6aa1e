"""Property tests over random metric histories, through the real tick graph (twin mode).

- never out of bounds, never more than one step per change;
- cooldowns kept: two forward changes of one target are at least cooldown_s
  apart (a rollback may come sooner: it undoes the last change);
- a change followed by a regression is rolled back.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.figures import slo_figures
from agents.knobs import get_knob, is_notice, is_replicas, knob_bounds
from agents.twin import TwinAgent
from tests.integration.agents_fixtures import WAN, healthy_snapshot, pdd_config

T0 = 10_000.0
CONFIG = pdd_config(cooldown_s=60, verify_after_s=30, confirm_ticks=2)

figure = st.one_of(st.none(), st.floats(min_value=0.005, max_value=8.0))
snapshot_fields = st.fixed_dictionaries(
    {
        "ttft_p": figure,
        "tpot_p": st.one_of(st.none(), st.floats(min_value=0.002, max_value=0.6)),
        "gap_p": figure,
        "rld_ongoing": st.floats(min_value=0, max_value=70),
        "md_ongoing": st.floats(min_value=0, max_value=140),
        "md_hit": st.floats(min_value=0.3, max_value=0.95),
        "wan_s": st.floats(min_value=0.03, max_value=2.0),
        "singular": st.floats(min_value=0, max_value=0.3),
        "valley": st.floats(min_value=0, max_value=1),
        "pmd_gap": st.floats(min_value=0.05, max_value=4.0),
    }
)
history = st.lists(st.tuples(st.floats(min_value=5, max_value=90), snapshot_fields), min_size=2, max_size=14)


def make_snapshot(at: float, x: dict, replicas: dict[str, int]):
    v = x["valley"] * 5
    return healthy_snapshot(
        at,
        ttft_p=x["ttft_p"],
        tpot_p=x["tpot_p"],
        tpot_p_by_pipeline={"P-MD": x["tpot_p"] or 0.02, "P-RLD-MD": 0.02},
        gap_p=x["gap_p"],
        gap_p99_by_pipeline={"P-MD": x["pmd_gap"], "P-RLD-MD": 0.2},
        prefix_hit_by_role={"prefill": 0.9, "main_decode": x["md_hit"]},
        singular_rate=x["singular"],
        md_hit_buckets={"0.2": 0.0, "0.5": v, "0.8": v, "0.95": 5.0, "+Inf": 5.0},
        kv_seconds_mean_by_link={WAN: x["wan_s"]},
        kv_seconds_p90_by_link={WAN: x["wan_s"] * 1.5},
        ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": x["rld_ongoing"], "MainDecode": x["md_ongoing"]},
        replicas_healthy_by_deployment={"Prefill": replicas["prefill"], "RelayDecode": replicas["relay_decode"], "MainDecode": replicas["main_decode"]},
        replicas_target_by_deployment={"Prefill": replicas["prefill"], "RelayDecode": replicas["relay_decode"], "MainDecode": replicas["main_decode"]},
    )


def value_of(target, knobs, replicas):
    return replicas[target.removeprefix("replicas.")] if is_replicas(target) else get_knob(knobs, target)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history)
def test_bounds_steps_and_cooldowns_hold_over_any_history(steps):
    agent = TwinAgent(CONFIG)
    now = T0
    replicas = dict(agent.actuator.replicas)
    last_forward: dict[str, float] = {}
    for dt, fields in steps:
        now += dt
        out = agent.tick(make_snapshot(now, fields, replicas))
        replicas = out.replicas
        rolled = {(c.target, c.old, c.new) for c in out.rollbacks}
        for c in out.changes:
            assert not is_notice(c.target)
            b = knob_bounds(CONFIG.agents, CONFIG, c.target)
            if b is not None and c.new is not None:  # None: an unset knob restored by a rollback
                assert b.min <= c.new <= b.max, c
                if c.old is not None:
                    assert abs(c.new - c.old) <= b.max_step + 1e-9, c
            if (c.target, c.old, c.new) not in rolled:
                if c.target in last_forward:
                    assert now - last_forward[c.target] >= CONFIG.agents.cooldown_s, c
                last_forward[c.target] = now
        for target, b in CONFIG.agents.bounds.items():
            value = get_knob(out.knobs, target)
            assert value is None or b.min <= value <= b.max
        for role, n in replicas.items():
            assert 1 <= n <= getattr(CONFIG.roles, role).max_replicas


BREACHES = {
    "ttft": dict(ttft_p=4.75, ttft_p_by_pipeline={"P-MD": 4.75, "P-RLD-MD": 4.75}),
    "rld": dict(ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 56.0, "MainDecode": 80.0}, gap_p=0.9),
    "relay": dict(ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 60.0, "MainDecode": 80.0}, gap_p=0.9),
    "wan": dict(kv_seconds_mean_by_link={WAN: 0.6}, gap_p=1.2),
    "tpot": dict(tpot_p=0.45, tpot_p_by_pipeline={"P-MD": 0.45, "P-RLD-MD": 0.02}),
}


@settings(max_examples=25, deadline=None)
@given(
    situation=st.sampled_from(sorted(BREACHES)),
    worse_by=st.floats(min_value=1.25, max_value=4.0),
    wait=st.floats(min_value=30, max_value=200),
)
def test_a_change_that_makes_the_slo_worse_is_rolled_back(situation, worse_by, wait):
    agent = TwinAgent(pdd_config(confirm_ticks=1))
    before = healthy_snapshot(T0, **BREACHES[situation])
    first = agent.tick(before)
    assert first.changes, first.decisions
    figures = slo_figures(before, agent.config.slo)
    worst = max(figures, key=figures.get)
    field = {"ttft": "ttft_p", "tpot": "tpot_p", "gap": "gap_p"}[worst]
    after = healthy_snapshot(T0 + wait, **{**BREACHES[situation], field: getattr(before, field) * worse_by})
    out = agent.tick(after)
    assert [v.outcome for v in out.verdicts] == ["rolled_back"]
    assert sorted(c.describe() for c in out.rollbacks) == sorted(c.reverse().describe() for c in first.changes)
    for c in first.changes:
        assert value_of(c.target, out.knobs, out.replicas) == c.old
