"""app/policy.py: every branch, and properties over random inputs (hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config import HandoffConfig, HandoffMode, RoutingConfig, SingularFilterConfig
from app.policy import (
    AUTO_ONE_SHOT_LOAD,
    GAP_CORRECTION_MAX_MS,
    MAX_CATCH_UP_ROUNDS,
    ClusterFacts,
    GapCorrection,
    HandoffStep,
    LinkBacklog,
    LinkFacts,
    Pipeline,
    RelayMachine,
    RelayPhase,
    RequestFacts,
    blocks_missing,
    choose_pipeline,
    decoder_wait_ms,
    expected_transfer_ms,
    next_handoff_step,
    relay_cap,
    resolve_handoff_mode,
)

BLOCK = 32
BYTES_PER_BLOCK = 32 * 4096
WAN = LinkFacts(bandwidth_bytes_per_s=5e6, rtt_s=0.03)


def cluster(load=0.0, rld=True):
    return ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=load, rld_available=rld)


def routing(**kw):
    return RoutingConfig(**kw)


def test_blocks_missing_counts_the_partial_last_block():
    assert blocks_missing(100, 0, 32) == 4
    assert blocks_missing(100, 64, 32) == 2
    assert blocks_missing(96, 96, 32) == 0
    assert blocks_missing(100, 70, 32) == 2  # a partial cached block does not count
    assert blocks_missing(50, 500, 32) == 1  # the partial last block is never cached
    assert blocks_missing(64, 500, 32) == 0


def test_expected_transfer_is_rtt_plus_bytes_over_bandwidth():
    assert expected_transfer_ms(0, BYTES_PER_BLOCK, WAN) == 0
    assert expected_transfer_ms(10, BYTES_PER_BLOCK, WAN) == pytest.approx((0.03 + 10 * BYTES_PER_BLOCK / 5e6) * 1000)


def test_backlog_drains_at_the_configured_bandwidth():
    backlog = LinkBacklog(bytes_per_s=1e6)
    assert backlog.queued(10.0) == 0
    backlog.add(500_000, 10.0)
    backlog.add(500_000, 10.2)  # 200 KB of the first pull moved in between
    assert backlog.queued(10.2) == 800_000
    assert backlog.queued(10.5) == 500_000
    assert backlog.queued(12.0) == 0
    backlog.add(100_000, 12.0)  # an idle link does not bank bandwidth for later
    assert backlog.queued(12.05) == 50_000


def test_what_a_pull_did_not_move_leaves_the_backlog_when_it_settles():
    backlog = LinkBacklog(bytes_per_s=1e6)
    first = backlog.add(500_000, 10.0)
    second = backlog.add(500_000, 10.0)
    backlog.settle(second, 500_000, 100_000, 10.1)  # its decoder's cache held more than routing thought
    assert backlog.queued(10.1) == 500_000  # 100 KB of the first moved; 400 KB of it, and the second's 100 KB, left
    backlog.settle(first, 500_000, 500_000, 10.2)  # moved all it was expected to: nothing changes
    assert backlog.queued(10.2) == 400_000


def test_a_pull_the_model_already_moved_settles_nothing_of_the_pulls_behind_it():
    backlog = LinkBacklog(bytes_per_s=1e6)
    first = backlog.add(500_000, 0.0)
    backlog.add(500_000, 0.0)
    backlog.settle(first, 500_000, 0, 0.4)  # 100 KB of it left in the model: only those go
    assert backlog.queued(0.4) == 500_000
    backlog.settle(first, 500_000, 0, 0.45)  # a second report of the same pull finds none of it left
    assert backlog.queued(0.45) == 450_000
    late = LinkBacklog(bytes_per_s=1e6)
    gone = late.add(500_000, 0.0)
    late.add(500_000, 0.6)
    late.settle(gone, 500_000, 0, 0.7)  # reported after the model moved it all
    assert late.queued(0.7) == 400_000


def test_a_backlog_can_move_a_request_onto_the_relay():
    req = RequestFacts(prompt_tokens=320, max_tokens=64, md_cached_tokens=0)  # 10 blocks: 292 ms, the token back 15 ms
    assert choose_pipeline(req, cluster(), routing(max_wan_transfer_ms=310)).pipeline is Pipeline.p_md
    behind = ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=0.0, wan_backlog_bytes=BYTES_PER_BLOCK)
    d = choose_pipeline(req, behind, routing(max_wan_transfer_ms=310))
    assert d.pipeline is Pipeline.p_rld_md and d.expected_wan_ms == pytest.approx(expected_transfer_ms(11, BYTES_PER_BLOCK, WAN))


def test_mds_wait_and_the_correction_are_part_of_the_gap():
    req = RequestFacts(prompt_tokens=320, max_tokens=64, md_cached_tokens=0)  # 10 blocks: 292 ms
    busy_md = ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=0.0, md_wait_ms=40.0)
    d = choose_pipeline(req, busy_md, routing(max_wan_transfer_ms=300))
    assert d.pipeline is Pipeline.p_rld_md and d.predicted_gap_ms == pytest.approx(d.expected_wan_ms + 40 + 15)  # + MD's token's way back
    assert "predicted gap 347 ms" in d.reason
    learned_faster = ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=0.0, md_wait_ms=40.0, gap_correction_ms=-65.0)
    assert choose_pipeline(req, learned_faster, routing(max_wan_transfer_ms=300)).pipeline is Pipeline.p_md


def test_mds_wait_is_the_step_in_progress_the_extend_step_and_the_requests_ahead():
    assert decoder_wait_ms(20.0, running=0, batch_limit=4) == 40.0
    assert decoder_wait_ms(20.0, running=3, batch_limit=4) == 40.0  # the last free slot
    assert decoder_wait_ms(20.0, running=5, batch_limit=4) == 80.0  # two requests ahead of it
    assert decoder_wait_ms(0.0, running=9, batch_limit=4) == 0.0  # no step seen yet: the correction learns it


def test_the_correction_learns_a_steady_error_and_forgets_it_when_turns_stop():
    c = GapCorrection(gain=0.25, half_life_s=60.0, max_ms=2000.0)
    assert c.value("wan|md-1", 0.0) == 0.0
    for t in range(40):
        c.observe("wan|md-1", uncorrected_ms=200.0, actual_ms=500.0, now=float(t))
    steady = 0.25 * 300 / (1 - 0.75 * 0.5 ** (1 / 60))  # the error, less what decays between turns
    assert 280 < c.value("wan|md-1", 39.0) == pytest.approx(steady, rel=0.01)
    assert c.value("wan|md-1", 99.0) == pytest.approx(steady / 2, rel=0.01)  # one half-life later
    assert c.value("wan|md-2", 39.0) == 0.0  # per MD replica


def test_the_correction_keeps_the_newest_keys():
    c = GapCorrection(max_keys=2)
    for i, key in enumerate(("a", "b", "c")):
        c.observe(key, 0.0, 100.0, float(i))
    c.observe("b", 0.0, 100.0, 3.0)
    c.observe("d", 0.0, 100.0, 4.0)
    assert c.value("a", 4.0) == 0.0 and c.value("c", 4.0) == 0.0
    assert c.value("b", 4.0) > 0 and c.value("d", 4.0) > 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 600)), min_size=1, max_size=50),
    st.floats(0.01, 1),
    st.floats(1, 1000),
)
def test_the_correction_stays_bounded_and_decays_toward_zero(turns, gain, half_life):
    c = GapCorrection(gain=gain, half_life_s=half_life, max_ms=1500.0)
    now = 0.0
    for uncorrected, actual, wait in turns:
        now += wait
        assert abs(c.observe("k", uncorrected, actual, now)) <= 1500.0
    last = c.value("k", now)
    later = c.value("k", now + half_life)
    assert abs(later) == pytest.approx(abs(last) / 2, abs=1e-6)
    assert abs(c.value("k", now + 50 * half_life)) < 1e-9 + abs(last) * 1e-12


def test_high_hit_goes_p_md():
    d = choose_pipeline(RequestFacts(4000, 100, 3968), cluster(), routing(max_wan_transfer_ms=300))
    assert d.pipeline is Pipeline.p_md and d.blocks_to_send == 1


def test_low_hit_goes_p_rld_md():
    d = choose_pipeline(RequestFacts(4000, 100, 0), cluster(), routing(max_wan_transfer_ms=300))
    assert d.pipeline is Pipeline.p_rld_md and d.expected_wan_ms > 300


def test_hit_rate_threshold_alternative():
    facts = RequestFacts(4000, 100, 3968 - 32 * 5)  # cheap transfer, but hit 95%
    assert choose_pipeline(facts, cluster(), routing(max_wan_transfer_ms=1000)).pipeline is Pipeline.p_md
    assert choose_pipeline(facts, cluster(), routing(max_wan_transfer_ms=1000, min_hit_rate=0.99)).pipeline is Pipeline.p_rld_md


def test_saturated_relay_sends_p_md():
    d = choose_pipeline(RequestFacts(4000, 100, 0), cluster(load=0.95), routing(max_relay_load=0.9))
    assert d.pipeline is Pipeline.p_md and "saturated" in d.reason


def test_singular_filter_finishes_on_rld():
    r = routing(singular=SingularFilterConfig(min_prompt_tokens=2048, max_hit_rate=0.2, max_output_tokens=8))
    assert choose_pipeline(RequestFacts(4000, 4, 0), cluster(), r).pipeline is Pipeline.p_rld
    assert choose_pipeline(RequestFacts(4000, 64, 0), cluster(), r).pipeline is Pipeline.p_rld_md  # long output
    assert choose_pipeline(RequestFacts(1000, 4, 0), cluster(), r).pipeline is Pipeline.p_rld_md  # short input
    assert choose_pipeline(RequestFacts(4000, 4, 2000), cluster(), r).pipeline is Pipeline.p_rld_md  # hit 50%
    off = routing(singular=SingularFilterConfig(enabled=False, min_prompt_tokens=2048, max_output_tokens=8))
    assert choose_pipeline(RequestFacts(4000, 4, 0), cluster(), off).pipeline is Pipeline.p_rld_md


facts_st = st.builds(
    RequestFacts,
    prompt_tokens=st.integers(1, 200_000),
    max_tokens=st.integers(1, 10_000),
    md_cached_tokens=st.integers(0, 200_000),
)
cluster_st = st.builds(
    ClusterFacts,
    kv_bytes_per_block=st.integers(1, 10**8),
    block_size=st.sampled_from([16, 32, 64, 128]),
    wan=st.builds(LinkFacts, bandwidth_bytes_per_s=st.floats(1e3, 1e11), rtt_s=st.floats(0, 1)),
    rld_load=st.floats(0, 2),
    rld_available=st.booleans(),
    wan_up=st.booleans(),
    md_wait_ms=st.floats(0, 5000),
    gap_correction_ms=st.floats(-GAP_CORRECTION_MAX_MS, GAP_CORRECTION_MAX_MS),
)
routing_st = st.builds(
    RoutingConfig,
    max_wan_transfer_ms=st.floats(0, 10_000),
    min_hit_rate=st.none() | st.floats(0, 1),
    max_relay_load=st.floats(0.01, 1),
    prefill_relays=st.booleans(),
    singular=st.builds(
        SingularFilterConfig,
        enabled=st.booleans(),
        min_prompt_tokens=st.integers(1, 100_000),
        max_hit_rate=st.floats(0, 1),
        max_output_tokens=st.integers(1, 100),
    ),
)


@settings(max_examples=500, deadline=None)
@given(facts_st, cluster_st, routing_st)
def test_p_rld_only_through_the_singular_filter(facts, cl, r):
    d = choose_pipeline(facts, cl, r)
    assert d.pipeline in (Pipeline.p_md, Pipeline.p_rld_md, Pipeline.p_rld, Pipeline.p_p_md)
    if d.pipeline is Pipeline.p_rld and cl.wan_up:
        s = r.singular
        assert s.enabled and facts.prompt_tokens >= s.min_prompt_tokens and facts.max_tokens <= s.max_output_tokens
        assert d.md_hit_rate <= s.max_hit_rate and cl.rld_available
    if d.pipeline is Pipeline.p_p_md:
        assert r.prefill_relays and not cl.rld_available
    elif d.pipeline is not Pipeline.p_md:
        assert cl.rld_available


@settings(max_examples=300, deadline=None)
@given(facts_st, cluster_st, routing_st)
def test_more_cache_never_moves_a_request_onto_the_relay(facts, cl, r):
    """Monotone: if MD holds more of the prompt, P-MD stays P-MD."""
    if not cl.wan_up:
        return
    if choose_pipeline(facts, cl, r).pipeline is Pipeline.p_md:
        more = RequestFacts(facts.prompt_tokens, facts.max_tokens, facts.md_cached_tokens + cl.block_size * 4)
        assert choose_pipeline(more, cl, r).pipeline is Pipeline.p_md


@settings(max_examples=300, deadline=None)
@given(facts_st, cluster_st, routing_st)
def test_the_predicted_gap_is_never_negative_and_includes_every_part(facts, cl, r):
    d = choose_pipeline(facts, cl, r)
    assert d.predicted_gap_ms >= 0
    assert d.uncorrected_gap_ms == pytest.approx(d.expected_wan_ms + cl.md_wait_ms + cl.wan.rtt_s * 500)
    assert d.predicted_gap_ms == pytest.approx(max(0.0, d.uncorrected_gap_ms + cl.gap_correction_ms))


def test_auto_mode_depends_on_relay_load():
    h = HandoffConfig(mode=HandoffMode.auto)
    assert resolve_handoff_mode(h, 0.0) is HandoffMode.catch_up
    assert resolve_handoff_mode(h, AUTO_ONE_SHOT_LOAD) is HandoffMode.one_shot
    assert resolve_handoff_mode(HandoffConfig(mode=HandoffMode.one_shot), 0.0) is HandoffMode.one_shot
    assert resolve_handoff_mode(HandoffConfig(mode=HandoffMode.catch_up), 0.99) is HandoffMode.catch_up


def test_catch_up_steps_until_little_is_left():
    h = HandoffConfig(catch_up_threshold_tokens=64)
    assert next_handoff_step(200, 0, HandoffMode.catch_up, h) is HandoffStep.catch_up
    assert next_handoff_step(64, 1, HandoffMode.catch_up, h) is HandoffStep.final
    assert next_handoff_step(200, MAX_CATCH_UP_ROUNDS, HandoffMode.catch_up, h) is HandoffStep.final
    assert next_handoff_step(10_000, 0, HandoffMode.one_shot, h) is HandoffStep.final


@given(st.integers(1, 4096), st.integers(1, 4096), st.floats(0, 3))
def test_relay_cap_shrinks_with_load_within_bounds(cap, floor, load):
    if floor > cap:
        floor, cap = cap, floor
    h = HandoffConfig(relay_cap_tokens=cap, min_relay_cap_tokens=floor)
    got = relay_cap(h, load)
    assert floor <= got <= cap
    assert relay_cap(h, min(load + 0.2, 3)) <= got


def test_wan_outage_finishes_requests_in_datacenter_a():
    down = ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=0.0, wan_up=False)
    d = choose_pipeline(RequestFacts(4000, 100, 3968), down, routing())
    assert d.pipeline is Pipeline.p_rld and "WAN down" in d.reason
    no_relay = ClusterFacts(BYTES_PER_BLOCK, BLOCK, WAN, rld_load=0.0, rld_available=False, wan_up=False)
    # MD's pull fails on the cut link and MD recomputes the prompt; P relays meanwhile
    assert choose_pipeline(RequestFacts(4000, 100, 0), no_relay, routing()).pipeline is Pipeline.p_p_md
    assert choose_pipeline(RequestFacts(4000, 100, 0), no_relay, routing(prefill_relays=False)).pipeline is Pipeline.p_md


def test_prefill_relays_while_no_relay_decoder_is_alive():
    lacking = RequestFacts(4000, 100, 0)
    d = choose_pipeline(lacking, cluster(rld=False), routing())
    assert d.pipeline is Pipeline.p_p_md and "prefill relays" in d.reason
    assert choose_pipeline(lacking, cluster(rld=False), routing(prefill_relays=False)).pipeline is Pipeline.p_md
    # a cheap transfer needs no relay, alive or not
    assert choose_pipeline(RequestFacts(4000, 100, 3968), cluster(rld=False), routing()).pipeline is Pipeline.p_md
    # a saturated relay decoder is alive: its requests pay the transfer, they do not load P
    assert choose_pipeline(lacking, cluster(load=1.0), routing()).pipeline is Pipeline.p_md


def test_the_relay_machine_catches_up_while_much_is_pending_then_hands_over():
    machine = RelayMachine.start(HandoffConfig(mode=HandoffMode.catch_up, catch_up_threshold_tokens=32, relay_cap_tokens=1000), rld_load=0.0)
    assert machine.take(100, last=False) == 100 and machine.phase is RelayPhase.relaying
    assert machine.md_step_done() is HandoffStep.catch_up and machine.sent == 100 and machine.rounds == 1  # the warm-up ended
    machine.take(20, last=False)
    assert machine.md_step_done() is HandoffStep.final and machine.phase is RelayPhase.handed_over  # 20 left: under the threshold


def test_the_relay_machine_stops_the_relay_at_its_cap_and_hands_over_at_mds_next_step():
    machine = RelayMachine.start(HandoffConfig(mode=HandoffMode.catch_up, relay_cap_tokens=64, min_relay_cap_tokens=64), rld_load=0.0)
    assert machine.take(50, last=False) == 50
    assert machine.take(50, last=True) == 14 and machine.phase is RelayPhase.waiting  # RLD's last tokens fall past the cap
    assert machine.take(5, last=False) == 0
    assert machine.md_step_done() is HandoffStep.final  # no catch-up once the relay stopped


def test_the_relay_machine_ends_on_the_relay_when_rld_finishes_first():
    machine = RelayMachine.start(HandoffConfig(mode=HandoffMode.one_shot, relay_cap_tokens=64, min_relay_cap_tokens=64), rld_load=0.0)
    assert machine.take(30, last=True) == 30 and machine.phase is RelayPhase.relay_finished


def test_an_md_that_fails_leaves_the_relay_uncapped_or_the_final_step_to_another_decoder():
    relaying = RelayMachine.start(HandoffConfig(relay_cap_tokens=64, min_relay_cap_tokens=64), rld_load=0.0)
    relaying.md_failed(max_tokens=500)
    assert relaying.take(400, last=False) == 400 and relaying.phase is RelayPhase.relaying
    stopped = RelayMachine.start(HandoffConfig(relay_cap_tokens=8, min_relay_cap_tokens=8), rld_load=0.0)
    stopped.take(8, last=False)
    stopped.md_failed(max_tokens=500)
    assert stopped.phase is RelayPhase.handed_over
