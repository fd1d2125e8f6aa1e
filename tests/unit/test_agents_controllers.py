"""Pure pieces of the swarm: knobs, controllers, figures, queries."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agents import figures as f
from agents.controllers import regressed, relay_cap_goal, step_toward, wan_threshold_goal
from agents.knobs import Change, get_knob, knob_bounds, limit, with_knobs
from app.config import AgentsConfig, KnobBounds, LiveKnobs, PDDConfig, RoleName
from app.telemetry import metrics as m
from app.telemetry.metrics import prom_name
from app.telemetry.queries import SERVE_SPECS, QuerySet
from app.telemetry.snapshot import Snapshot
from tests.integration.agents_fixtures import WAN, healthy_snapshot, pdd_args, pdd_config

ROOT = Path(__file__).resolve().parents[2]
B = KnobBounds(min=0, max=5000, max_step=200)


def test_step_toward_moves_one_step_at_most():
    assert step_toward("routing.max_wan_transfer_ms", 300, 30, B) == 100
    assert step_toward("routing.max_wan_transfer_ms", 300, 250, B) == 250


def test_step_toward_respects_bounds():
    assert step_toward("routing.max_wan_transfer_ms", 100, -900, B) == 0
    assert step_toward("routing.max_wan_transfer_ms", 4900, 9000, B) == 5000


def test_step_toward_deadband_refuses_tiny_moves():
    assert step_toward("routing.max_wan_transfer_ms", 300, 310, B) is None


def test_integer_knob_rounds_towards_start_within_step():
    b = KnobBounds(min=32, max=4096, max_step=100)
    assert limit("handoff.relay_cap_tokens", 512, 400.7, b) == 412
    assert limit("handoff.relay_cap_tokens", 512, 700.2, b) == 612
    assert isinstance(limit("handoff.relay_cap_tokens", 512, 700.2, b), int)


def test_unset_knob_starts_at_its_minimum():
    b = KnobBounds(min=0, max=0.95, max_step=0.1)
    assert step_toward("routing.min_hit_rate", None, 0.8, b) == pytest.approx(0.1)
    assert step_toward("routing.min_hit_rate", None, 0.0, b) is None


def test_wan_threshold_goal_scales_with_slowdown():
    assert wan_threshold_goal(300, 10) == 30
    assert wan_threshold_goal(300, 0.5) == 300


def test_relay_cap_goal_covers_the_transfer():
    assert relay_cap_goal(2.0, 0.02) == 150
    assert relay_cap_goal(1.0, 0) == 0


@pytest.mark.parametrize(
    "before,after,worse",
    [(0.8, 0.95, True), (0.8, 0.85, False), (1.2, 0.9, False), (0.2, 0.45, False), (0.2, 0.7, True), (None, 2.0, False)],
)
def test_regressed(before, after, worse):
    assert regressed(before, after, 0.1) is worse


def test_knob_paths_read_and_write():
    knobs = LiveKnobs()
    assert get_knob(knobs, "handoff.mode") == "auto"
    new = with_knobs(knobs, {"routing.singular.enabled": False, "handoff.relay_cap_tokens": 256})
    assert get_knob(new, "routing.singular.enabled") is False and new.handoff.relay_cap_tokens == 256
    with pytest.raises(ValueError):
        with_knobs(knobs, {"handoff.relay_cap_tokens": 8})  # below min_relay_cap_tokens
    with pytest.raises(ValueError):
        with_knobs(knobs, {"routing.nope": 1})


def test_replica_bounds_come_from_the_role():
    config = pdd_config()
    b = knob_bounds(config.agents, config, "replicas.relay_decode")
    assert (b.min, b.max, b.max_step) == (1, 3, 1)
    assert knob_bounds(config.agents, config, "routing.max_relay_load") is None


def test_change_reverse_and_describe():
    c = Change(target="routing.max_wan_transfer_ms", old=300.0, new=100.0)
    assert c.reverse() == Change(target="routing.max_wan_transfer_ms", old=100.0, new=300.0)
    assert c.describe() == "routing.max_wan_transfer_ms: 300 -> 100"


def test_bounds_must_name_numeric_live_knobs():
    with pytest.raises(ValueError, match="handoff.mode"):
        AgentsConfig(bounds={"handoff.mode": {"min": 0, "max": 1, "max_step": 1}})


def test_slo_figures_and_score():
    config = pdd_config()
    figs = f.slo_figures(healthy_snapshot(ttft_p=4.0), config.slo)
    assert figs["ttft"] == pytest.approx(2.0)
    assert f.slo_score(figs) == pytest.approx(2.0)
    assert f.slo_score({}) is None


def test_hit_cdf_interpolates_and_valley_share():
    buckets = {"0.2": 0.0, "0.6": 5.0, "0.8": 5.0, "+Inf": 10.0}
    assert f.hit_cdf(buckets, 0.4) == pytest.approx(0.25)
    assert f.hit_cdf(buckets, 0.8) == pytest.approx(0.5)
    snap = healthy_snapshot(md_hit_buckets=buckets)
    assert f.valley_share(snap) == pytest.approx(0.5)
    assert f.valley_share(healthy_snapshot(md_hit_buckets={})) is None


def test_wan_links_compare_with_the_link_model():
    config = pdd_config()
    [link] = f.wan_links(healthy_snapshot(kv_seconds_mean_by_link={WAN: 0.6}), config)
    assert link.link == WAN
    assert link.expected_s == pytest.approx(0.04 + 100_000 * 8 / 40e6)
    assert link.slowdown == pytest.approx(10)


def _situations(snap, config):
    from agents.diagnose import diagnose
    from agents.memory import Memory

    return diagnose(snap, config, config.agents, config.live_knobs(), Memory(), snap.at)[0]


def test_wan_links_judge_pulls_against_the_link_shared_as_it_was():
    """Pulls 3x an idle link's time on a link shared by three at once are healthy: the
    conductor's per-pull slowdown (vs LinkShare) decides, not the idle link's time."""
    config = pdd_config()
    idle = f.expected_pull_s(config.link("dc-a", "dc-b"), 100_000)
    busy = healthy_snapshot(kv_seconds_mean_by_link={WAN: 3 * idle}, kv_slowdown_mean_by_link={WAN: 1.05})
    [link] = f.wan_links(busy, config)
    assert link.shared and link.slowdown == pytest.approx(1.05) and link.expected_s == pytest.approx(3 * idle / 1.05)
    assert _situations(busy, config) == []
    slow = healthy_snapshot(kv_seconds_mean_by_link={WAN: 3 * idle}, kv_slowdown_mean_by_link={WAN: 3.0})
    [found] = _situations(slow, config)
    assert found.name == "wan_degradation" and "3.0x slower" in found.summary
    assert "slowdown" in found.evidence[1].query and found.evidence[1].value == 3.0
    [idle_judged] = f.wan_links(healthy_snapshot(kv_seconds_mean_by_link={WAN: 3 * idle}), config)
    assert not idle_judged.shared and idle_judged.slowdown == pytest.approx(3.0)  # no sized pulls: an idle link's time


def test_wan_links_expect_the_configured_jitter_and_stalls():
    """A link behaving exactly as configured, jitter and stalls included, is not degraded."""
    args = pdd_args()
    args["links"][1] |= {"jitter": {"distribution": "lognormal", "mean_ms": 5, "std_ms": 10}, "stall": {"probability": 0.01, "duration_ms": 1000}}
    config = PDDConfig.model_validate(args)
    wan = config.link("dc-a", "dc-b")
    assert f.expected_pull_s(wan, 100_000) == pytest.approx(0.04 + 0.005 + 0.01 + 100_000 * 8 / 40e6)
    [link] = f.wan_links(healthy_snapshot(kv_seconds_mean_by_link={WAN: f.expected_pull_s(wan, 100_000)}), config)
    assert link.slowdown == pytest.approx(1.0)


def test_role_load_uses_serve_metrics():
    config = pdd_config()
    assert f.role_load(healthy_snapshot(), config, RoleName.prefill) == pytest.approx(30 / 64)


def test_every_query_fills_a_snapshot_field_and_names_come_from_prom_name():
    qs = QuerySet(window_s=30, percentile=90, app_name="pdd", matchers={"job": "x"})
    queries = qs.all()
    fields = set(Snapshot.model_fields)
    assert {q.name for q in queries} <= fields
    assert fields - {q.name for q in queries} == {"at", "window_s", "promql"}
    names = {prom_name(s, sfx) for s in (*m.ALL, *SERVE_SPECS) for sfx in ("", "_bucket", "_sum", "_count")}
    for q in queries:
        used = {tok for tok in re.findall(r"\b(ray_[a-z_]+)\{", q.promql)}
        assert used and used <= names, q.promql
        assert 'job="x"' in q.promql
    serve = [q for q in queries if "ray_serve" in q.promql]
    assert serve and all('application="pdd"' in q.promql for q in serve)
    assert not any("{}" in q.promql for q in QuerySet(window_s=30, percentile=90, app_name="pdd").all())


def test_conductor_name_matches_the_ingress_deployment():
    from agents.actuate import CONDUCTOR

    tree = ast.parse((ROOT / "app" / "api" / "ingress.py").read_text())
    names = [
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for dec in node.decorator_list
        if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "deployment"
        for kw in dec.keywords
        if kw.arg == "name"
    ]
    assert CONDUCTOR in names


def test_serve_metric_specs_match_what_ray_serve_registers():
    import ray.serve._private as serve_private

    source = "".join(p.read_text() for p in Path(serve_private.__file__).parent.glob("*.py"))
    for spec in SERVE_SPECS:
        # a counter may be registered with or without its `_total`; Ray exports it with one
        assert f'"{spec.name}"' in source or f'"{spec.name}_total"' in source, spec.name
