"""The worst-gap objective: its breach by pipeline and cause, the relay saturated by a threshold set
too low, and knobs that return to the config's value only while that does not bring a breach back."""

from __future__ import annotations

import pytest

from agents.knobs import with_knobs
from agents.memory import Memory
from tests.integration.agents_fixtures import WAN, healthy_snapshot, pdd_args, pdd_config
from tests.unit.test_agents_specialists import CASES, propose_all, situations_of

THRESHOLD = "routing.max_wan_transfer_ms"
RELAY_CAP = "handoff.relay_cap_tokens"
P_MD_BREACH = CASES["gap_slo_breach"]
P_RLD_MD_BREACH = dict(gap_p=1.6, gap_p99_by_pipeline={"P-MD": 0.25, "P-RLD-MD": 2.4})
#: RLD 20 of 64 busy: the cap of 512 allows 352 tokens; a p90 of 340 runs to it.
AT_CAP = dict(relay_tokens_p90=340.0)
RELAY_FULL = CASES["relay_saturated"]


def knobs(**paths):
    return with_knobs(pdd_config().live_knobs(), {k.replace("__", "."): v for k, v in paths.items()})


def changes(proposals, specialist=None):
    return [(p.specialist, p.change.target, p.change.old, p.change.new) for p in proposals if specialist in (None, p.specialist)]


# ---- gap breach on P-MD: the threshold is too high for the gap ------------------------------------


def test_a_p_md_gap_breach_on_a_healthy_link_names_the_pipeline_and_the_threshold():
    [s] = situations_of(healthy_snapshot(**P_MD_BREACH))
    assert (s.name, s.subject, s.severity) == ("gap_slo_breach", "P-MD", 2)
    assert "P-MD worst-gap p99 2400 ms" in s.summary and "on a link 1.0x its model" in s.summary
    assert "routing.max_wan_transfer_ms 300 ms is too high for the gap" in s.summary
    assert "the gap prediction misses 350 ms a turn" in s.summary
    errors = [e for e in s.evidence if e.query == "gap_error_mean_by_link"]
    assert [(e.value, e.note.split(":")[0]) for e in errors] == [(0.35, WAN)]
    [threshold] = [e for e in s.evidence if e.query == THRESHOLD]
    assert (threshold.value, threshold.threshold) == (300.0, pytest.approx(650.0))  # 1000 ms target less the 350 ms error


def test_the_threshold_comes_down_one_step_each_time():
    assert changes(propose_all(healthy_snapshot(**P_MD_BREACH), knobs=knobs(routing__max_wan_transfer_ms=5000.0))) == [("routing", THRESHOLD, 5000.0, 4800.0)]


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(kv_seconds_mean_by_link={WAN: 0.6}), "wan_degradation"),  # the link: threshold goal intent / slowdown
        (dict(md_hit_buckets={"0.2": 0.0, "0.5": 2.5, "0.8": 2.5, "0.95": 5.0, "+Inf": 5.0}), "bathtub_valley"),
        (dict(kv_failure_rate_by_link={WAN: 0.5}, kv_lease_gone_rate_by_link={WAN: 0.5}), "wan_saturated"),
    ],
)
def test_a_p_md_gap_breach_another_situation_explains_is_not_named_twice(fields, named):
    snap = healthy_snapshot(**P_MD_BREACH, **fields)
    assert [s.name for s in situations_of(snap)] == [named]
    assert len([p for p in propose_all(snap) if p.change.target == THRESHOLD]) <= 1


def test_a_p_md_gap_breach_routing_cannot_answer_goes_to_a_person():
    at_floor = propose_all(healthy_snapshot(**P_MD_BREACH), knobs=knobs(routing__max_wan_transfer_ms=0.0))
    assert changes(at_floor) == [("clerk", "notice.gap_slo_breach:P-MD", None, at_floor[0].change.new)]
    # more relays while RLD is overloaded would make that worse
    busy = healthy_snapshot(**P_MD_BREACH, ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 56.0, "MainDecode": 80.0})
    assert {s.name for s in situations_of(busy)} == {"rld_overload", "gap_slo_breach"}
    assert THRESHOLD not in {p.change.target for p in propose_all(busy)}
    assert "notice.gap_slo_breach:P-MD" in {p.change.target for p in propose_all(busy)}


def test_a_handful_of_slow_gaps_is_no_breach():
    few = healthy_snapshot(**P_MD_BREACH, slo_violation_rate_by_slo={"gap": 2 / 6})
    assert situations_of(few) == []
    # 0.9x the target, 6 requests over it: inside the band only while active
    held = healthy_snapshot(**{**P_MD_BREACH, "gap_p": 0.9}, slo_violation_rate_by_slo={"gap": 1.0})
    assert situations_of(held) == []
    [s] = situations_of(held, memory=Memory(streaks={"gap_slo_breach:P-MD": 2}))
    assert s.key == "gap_slo_breach:P-MD" and s.streak == 3


# ---- gap breach on P-RLD-MD: handoff stalls ---------------------------------------------------------


def test_a_p_rld_md_breach_whose_relays_run_to_their_cap_raises_it():
    [s] = situations_of(healthy_snapshot(**P_RLD_MD_BREACH, **AT_CAP))
    assert (s.name, s.subject) == ("gap_slo_breach", "P-RLD-MD")
    assert "relays run to their cap (340 tokens p90 of 352 at RLD's load)" in s.summary
    assert changes(propose_all(healthy_snapshot(**P_RLD_MD_BREACH, **AT_CAP))) == [("handoff", RELAY_CAP, 512, 768)]


def test_a_p_rld_md_breach_with_one_shot_handoffs_goes_auto():
    one_shot = knobs(handoff__mode="one_shot")
    [s] = situations_of(healthy_snapshot(**P_RLD_MD_BREACH), knobs=one_shot)
    assert "one-shot handoffs" in s.summary
    assert changes(propose_all(healthy_snapshot(**P_RLD_MD_BREACH), knobs=one_shot)) == [("handoff", "handoff.mode", "one_shot", "auto")]
    # relays short of their cap and handoffs already in two steps: nothing to turn, a person looks
    assert [p.change.target for p in propose_all(healthy_snapshot(**P_RLD_MD_BREACH))] == ["notice.gap_slo_breach:P-RLD-MD"]


def test_a_p_rld_md_breach_under_rld_overload_is_the_overload_s():
    busy = healthy_snapshot(**P_RLD_MD_BREACH, **AT_CAP, ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 56.0, "MainDecode": 80.0})
    assert [s.name for s in situations_of(busy)] == ["rld_overload"]
    assert ("handoff", RELAY_CAP, 512, 256) in changes(propose_all(busy))


# ---- relay saturated: the threshold is too low ------------------------------------------------------


def test_a_saturated_relay_with_p_md_gaps_to_spare_raises_the_threshold_not_rld():
    [s] = situations_of(healthy_snapshot(**RELAY_FULL))
    assert (s.name, s.severity) == ("relay_saturated", 2)
    assert s.summary.startswith("relay decoders 94% busy, at routing.max_relay_load 90%, while P-MD's worst-gap p99 is 248 ms")
    got = changes(propose_all(healthy_snapshot(**RELAY_FULL), knobs=knobs(routing__max_wan_transfer_ms=0.0)))
    assert got == [("routing", THRESHOLD, 0.0, 200.0)]  # no relay replica, no shorter relays


def test_the_raise_goes_above_the_config_but_not_past_the_gap_target_less_the_error():
    above = propose_all(healthy_snapshot(**RELAY_FULL), knobs=knobs(routing__max_wan_transfer_ms=700.0))
    assert changes(above) == [("routing", THRESHOLD, 700.0, 900.0)]  # the config says 300
    assert changes(propose_all(healthy_snapshot(**RELAY_FULL), knobs=knobs(routing__max_wan_transfer_ms=900.0))) == [("routing", THRESHOLD, 900.0, 1000.0)]
    err = dict(RELAY_FULL, gap_error_mean_by_link={WAN: 0.3})  # ceiling 700 ms
    assert changes(propose_all(healthy_snapshot(**err), knobs=knobs(routing__max_wan_transfer_ms=600.0))) == [("routing", THRESHOLD, 600.0, 700.0)]
    # at the ceiling routing cannot help: the same load is rld_overload, whose remedies act
    at_ceiling = healthy_snapshot(**err)
    assert [s.name for s in situations_of(at_ceiling, knobs=knobs(routing__max_wan_transfer_ms=700.0))] == ["rld_overload"]


@pytest.mark.parametrize(
    "fields",
    [
        dict(gap_p99_by_pipeline={"P-MD": 0.7, "P-RLD-MD": 0.25}),  # P-MD's gaps have no room
        dict(kv_seconds_mean_by_link={WAN: 0.1}),  # a link 1.7x its model: not as configured
        dict(ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 56.0, "MainDecode": 80.0}),  # busy, short of max_relay_load
    ],
)
def test_a_busy_relay_routing_cannot_relieve_is_rld_overload(fields):
    assert [s.name for s in situations_of(healthy_snapshot(**{**RELAY_FULL, **fields}))] == ["rld_overload"]


def test_relay_saturated_holds_inside_its_band_while_active():
    lower = dict(RELAY_FULL, ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 52.0, "MainDecode": 80.0})  # 0.81 / 0.9
    assert [s.name for s in situations_of(healthy_snapshot(**lower))] == []
    assert [s.name for s in situations_of(healthy_snapshot(**lower), memory=Memory(streaks={"relay_saturated": 2}))] == ["relay_saturated"]


# ---- knobs return to intent only while that does not bring the breach back --------------------------


def test_a_threshold_lowered_for_the_gap_returns_only_while_p_md_gaps_have_room():
    low = knobs(routing__max_wan_transfer_ms=100.0)
    tight = healthy_snapshot(gap_p99_by_pipeline={"P-MD": 0.7, "P-RLD-MD": 0.25})  # cleared, but 0.7 of the target
    assert situations_of(tight, knobs=low) == []
    [s] = situations_of(healthy_snapshot(), knobs=low)
    assert (s.name, s.subject, s.severity) == ("return_to_intent", THRESHOLD, 0)
    assert "P-MD worst-gap p99 / the gap target 0.25 < 0.5" in s.summary
    # while the breach lasts the threshold only goes down
    assert [s.name for s in situations_of(healthy_snapshot(**P_MD_BREACH), knobs=low)] == ["gap_slo_breach"]


def test_a_wrong_config_value_is_approached_only_as_far_as_the_gaps_allow():
    args = pdd_args()
    args["routing"] = {"max_wan_transfer_ms": 5000.0}  # the operator's mistake is in the file
    config = type(pdd_config()).model_validate(args)
    lowered = with_knobs(config.live_knobs(), {THRESHOLD: 1000.0})
    near = healthy_snapshot(gap_p99_by_pipeline={"P-MD": 0.55, "P-RLD-MD": 0.25})
    assert propose_all(near, knobs=lowered, config=config) == []
    room = propose_all(healthy_snapshot(), knobs=lowered, config=config)
    assert changes(room) == [("routing", THRESHOLD, 1000.0, 1200.0)]


def test_a_threshold_raised_for_a_saturated_relay_comes_back_down_once_rld_has_headroom():
    high = knobs(routing__max_wan_transfer_ms=700.0)
    busy = healthy_snapshot(ongoing_by_deployment={"Prefill": 30.0, "RelayDecode": 40.0, "MainDecode": 80.0})  # 0.63
    assert situations_of(busy, knobs=high) == []
    assert changes(propose_all(healthy_snapshot(), knobs=high)) == [("routing", THRESHOLD, 700.0, 500.0)]


def test_a_relay_cap_raised_for_handoff_stalls_comes_back_only_while_p_rld_md_has_room():
    raised = knobs(handoff__relay_cap_tokens=768)
    assert situations_of(healthy_snapshot(gap_p99_by_pipeline={"P-MD": 0.25, "P-RLD-MD": 0.7}), knobs=raised) == []
    assert changes(propose_all(healthy_snapshot(), knobs=raised)) == [("handoff", RELAY_CAP, 768, 512)]
    # on a slow link (wan_degradation still holding it) it stays
    slow = healthy_snapshot(kv_seconds_mean_by_link={WAN: 0.6})
    assert "return_to_intent" not in [s.name for s in situations_of(slow, knobs=raised)]
