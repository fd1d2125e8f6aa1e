"""The twin's physical models in isolation: step times, decode ramps, fitting, caches, links."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config import AcceleratorSpec, LinkConfig, ModelSpec, PullOrder
from app.sim.cache import PrefixCache, merged, usable_tokens
from app.sim.engine import Instance
from app.sim.events import Loop
from app.sim.jobs import Gaps
from app.sim.network import Link, PullSlots
from app.sim.perf import DecodeRamp, FittedPerf, Roofline, StepSample, fit_from_samples, load_perf, load_samples, roles_to_json, save_samples
from app.sim.work import Seq

ACC = AcceleratorSpec(peak_tflops=100, memory_bandwidth_gbps=1000, memory_gib=80)
MODEL = ModelSpec(active_params_b=1, total_params_b=4, weight_bytes_per_param=2, kv_bytes_per_token=1000, attention_flops_per_token_pair=1e6)


# ---- roofline ----------------------------------------------------------------------


def test_roofline_prefill_is_compute_bound_by_hand():
    r = Roofline(ACC, MODEL, gpus=2)
    # 1000 new tokens on an empty context: 2e9 FLOP per token, 1000*1001/2 attention pairs
    flops = 1000 * 2e9 + 500_500 * 1e6
    memory = 4e9 * 2 + 1000 * 1000  # a 1000-token step reads every weight (4B params x 2 bytes)
    assert r.step_s(1000, 0, 1000, 500_500) == pytest.approx(max(flops / 200e12, memory / 2000e9), rel=1e-12)
    assert flops / 200e12 > memory / 2000e9


def test_roofline_small_decode_reads_only_active_weights():
    r = Roofline(ACC, MODEL)
    # 3 sequences touch 3 x 1B active parameters, under the 4B total
    assert r.step_s(0, 3, 30_000, 30_000) == pytest.approx((3 * 2e9 + 30_000 * 1000) / 1000e9, rel=1e-12)


def test_roofline_efficiency_and_overhead():
    acc = ACC.model_copy(update={"compute_efficiency": 0.5, "bandwidth_efficiency": 0.25, "step_overhead_ms": 3})
    r = Roofline(acc, MODEL)
    assert r.step_s(0, 1, 0, 0) == pytest.approx(2e9 / 250e9 + 0.003, rel=1e-12)


def _decode_steps_brute(perf, n: int, k0: float, steps: int) -> list[float]:
    return [perf.step_s(0, n, k0 + k * n, k0 + k * n) for k in range(steps)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), k0=st.integers(0, 5_000_000), steps=st.integers(1, 300))
def test_decode_ramp_sums_the_steps_exactly(n, k0, steps):
    # attention FLOPs high enough that long contexts flip decode to compute-bound mid-ramp
    model = MODEL.model_copy(update={"attention_flops_per_token_pair": 4e8})
    perf = Roofline(ACC, model)
    ramp = DecodeRamp(perf.decode_lines(n, k0))
    brute = _decode_steps_brute(perf, n, k0, steps)
    assert ramp.cum(steps) == pytest.approx(math.fsum(brute), rel=1e-9)
    assert ramp.step(steps - 1) == pytest.approx(brute[-1], rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), k0=st.integers(0, 2_000_000), t=st.floats(0, 30))
def test_decode_ramp_inverse(n, k0, t):
    ramp = DecodeRamp(Roofline(ACC, MODEL.model_copy(update={"attention_flops_per_token_pair": 4e8})).decode_lines(n, k0))
    m = ramp.steps_within(t)
    assert ramp.cum(m) <= t < ramp.cum(m + 1)


def test_decode_ramp_rejects_a_zero_step():
    with pytest.raises(ValueError):
        DecodeRamp((0.0, 0.0, 0.0, 0.0))


# ---- fitting -------------------------------------------------------------------------


def _samples(a, b, c, d, shapes, noise=lambda i: 0.0, e=0.0, f=0.0):
    """Steps of a model with those coefficients; a shape's pairs are its prefill's own (p^2/2) plus its decode reads;
    a prefill beside the largest context reads it as a prefix (one chunk after a prefix)."""
    out = []
    for i, (p, s, k) in enumerate(shapes):
        pairs = p * p / 2 + (k if s else 0)
        chunks = int(p > 0 and k == 4000)
        out.append(StepSample(p, s, k, (a + b * p + c * s + d * k + e * pairs + f * chunks) * (1 + noise(i)), pairs, prefix_chunks=chunks))
    return out


SHAPES = [(p, s, k) for p in (0, 32, 256, 1024) for s in (0, 1, 8, 32) for k in (0, 500, 4000) if p or s]


def test_fit_recovers_the_generating_coefficients():
    fitted = fit_from_samples(_samples(4.0, 0.02, 0.7, 0.001, SHAPES, noise=lambda i: 0.002 * ((i * 7919) % 11 - 5) / 5, e=2e-5, f=3.0))
    assert fitted.a_ms == pytest.approx(4.0, rel=0.02)
    assert fitted.b_ms_per_prefill_token == pytest.approx(0.02, rel=0.02)
    assert fitted.c_ms_per_decode_seq == pytest.approx(0.7, rel=0.02)
    assert fitted.d_ms_per_kv_token == pytest.approx(0.001, rel=0.05)
    assert fitted.e_ms_per_attention_pair == pytest.approx(2e-5, rel=0.05)
    assert fitted.f_ms_per_prefix_chunk == pytest.approx(3.0, rel=0.05)
    assert fitted.step_s(100, 4, 1000, 9000) == pytest.approx((4.0 + 2 + 2.8 + 1 + 0.18) / 1000, rel=0.01)
    assert fitted.step_s(100, 4, 1000, 9000, 2) == pytest.approx((4.0 + 2 + 2.8 + 1 + 0.18 + 6.0) / 1000, rel=0.01)


#: Steps a calibration measured on a 2-core dev machine (ms, two repeats per shape):
#: prefill N fresh tokens; decode n sequences reading K context tokens.
MEASURED_PREFILL = {64: (17.2, 9.0), 256: (38.4, 19.6), 512: (65.8, 35.8), 1024: (130.6, 86.5), 2048: (299.9, 236.2)}
MEASURED_DECODE = {
    (1, 280): (3.46, 2.93),
    (1, 4120): (4.08, 4.39),
    (4, 1120): (4.03, 3.85),
    (4, 8288): (7.02, 6.61),
    (8, 8384): (7.39, 7.34),
    (16, 8576): (8.69, 8.38),
    (16, 33152): (19.04, 18.94),
}


def test_fit_keeps_small_steps_right_beside_large_ones():
    # the prefill steps are 10-100x the decode steps and noisy: fitting absolute
    # errors let them decide alone, and put a lone decode step at -86%
    samples = [StepSample(n, 0, n, ms, n * (n + 1) / 2) for n, pair in MEASURED_PREFILL.items() for ms in pair]
    samples += [StepSample(0, s, k, ms, k) for (s, k), pair in MEASURED_DECODE.items() for ms in pair]
    fitted = fit_from_samples(samples)
    for (s, k), pair in MEASURED_DECODE.items():
        assert fitted.step_s(0, s, k, k) * 1000 == pytest.approx(sum(pair) / 2, rel=0.15), (s, k)
    for n, pair in MEASURED_PREFILL.items():
        assert fitted.step_s(n, 0, n, n * (n + 1) / 2) * 1000 == pytest.approx(sum(pair) / 2, rel=0.4), n


def test_fit_never_returns_a_negative_cost():
    # step time falls with decode_seqs in these samples: that slope is pinned to 0, the rest refitted
    samples = [StepSample(p, s, 0, 10 + 0.05 * p - 0.5 * s) for p in (0, 100, 400) for s in (1, 4, 8)]
    fitted = fit_from_samples(samples)
    assert fitted.c_ms_per_decode_seq == 0
    assert fitted.b_ms_per_prefill_token == pytest.approx(0.05, rel=0.05)
    assert min(fitted.a_ms, fitted.b_ms_per_prefill_token, fitted.d_ms_per_kv_token) >= 0


def test_fit_needs_samples():
    with pytest.raises(ValueError):
        fit_from_samples([StepSample(1, 1, 1, 1.0)])


def test_samples_and_model_json_roundtrip(tmp_path):
    samples = _samples(1.0, 0.1, 0.2, 0.003, SHAPES[:10])
    path = tmp_path / "steps.json"
    save_samples(path, samples)
    assert load_samples(path) == samples
    fitted = fit_from_samples(load_samples(path))
    assert FittedPerf.from_json(fitted.to_json()) == fitted
    (tmp_path / "one.json").write_text(fitted.to_json())
    assert load_perf(tmp_path / "one.json") == fitted
    roles = {
        "prefill": replace(
            fitted, serving_overhead_ms=17.5, serving_overhead_ms_per_in_flight=3.5, kv_pull_ms=4.0, kv_pull_ms_per_mb=4.5, decoder_request_overhead_ms=6.5
        ),
        "main_decode": replace(fitted, neighbor_slowdown=0.4).scaled(1.5),
    }
    assert roles["main_decode"].neighbor_slowdown == 0.4  # a share of the step, whatever its scale
    assert roles["main_decode"].step_s(100, 4, 1000, 9000) == pytest.approx(1.5 * fitted.step_s(100, 4, 1000, 9000), rel=1e-12)
    (tmp_path / "roles.json").write_text(roles_to_json(roles))
    assert load_perf(tmp_path / "roles.json") == roles


def test_a_model_saved_before_the_serving_overhead_and_host_sharing_reads_with_none(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"a_ms": 2.0, "b_ms_per_prefill_token": 0.01, "c_ms_per_decode_seq": 0.5, "d_ms_per_kv_token": 0.002}')
    model = load_perf(path)
    assert (model.serving_overhead_ms, model.serving_overhead_ms_per_in_flight, model.neighbor_slowdown) == (0.0, 0.0, 0.0)
    assert (model.f_ms_per_prefix_chunk, model.decoder_request_overhead_ms, model.kv_pull_ms, model.kv_pull_ms_per_mb) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"a_ms": 1.0, "steps": []}', "b_ms_per_prefill_token: Field required"),
        ('{"a_ms": 1.0, "steps": []}', "steps: Unexpected keyword argument"),
        ('{"a_ms": -1, "b_ms_per_prefill_token": 0, "c_ms_per_decode_seq": 0, "d_ms_per_kv_token": 0}', "a_ms: Input should be greater than or equal to 0"),
        (
            '{"a_ms": 1, "b_ms_per_prefill_token": 0, "c_ms_per_decode_seq": 0, "d_ms_per_kv_token": 0, "serving_overhead_ms_per_in_flight": -2}',
            "serving_overhead_ms_per_in_flight: Input should be greater than or equal to 0",
        ),
        ("[]", "expected a fitted model (an object), got a list"),
        ("{oops", "not JSON"),
        ('{"roles": {"prefil": {}}}', "roles.prefil: not a role"),
        (
            '{"roles": {"prefill": {"a_ms": 1, "b_ms_per_prefill_token": 0, "c_ms_per_decode_seq": 0, "d_ms_per_kv_token": "x"}}}',
            "roles.prefill.d_ms_per_kv_token: Input should be a valid number",
        ),
    ],
)
def test_a_file_that_is_no_fitted_model_is_named(tmp_path, text, named):
    path = tmp_path / "samples.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_perf(path)
    assert str(err.value).startswith(f"{path}: ") and named in str(err.value)


def test_fitted_decode_lines_match_its_steps():
    f = FittedPerf(2.0, 0.01, 0.5, 0.002)
    ramp = DecodeRamp(f.decode_lines(5, 1000))
    assert ramp.cum(10) == pytest.approx(math.fsum(f.step_s(0, 5, 1000 + 5 * k) for k in range(10)), rel=1e-12)


# ---- prefix cache ----------------------------------------------------------------------


def test_lru_evicts_tail_blocks_of_the_oldest_entry_first():
    c = PrefixCache(limit_tokens=100, block_size=10)
    c.put("a", 55, 0)  # whole blocks only: 50
    c.put("b", 40, 0)
    assert (c.used, c.peek("a")) == (90, (50, 0))
    c.put("c", 30, 0)  # 20 over: a loses its last two blocks
    assert c.peek("a") == (30, 0) and c.peek("b") == (40, 0) and c.used == 100
    c.put("a", 30, 1)  # touching a makes b the oldest
    c.put("d", 40, 0)
    assert c.peek("b") is None and c.peek("c") == (30, 0) and c.used == 100
    assert c.evicted_tokens == 20 + 40


def test_pinned_entries_survive_eviction_and_are_shared():
    c = PrefixCache(limit_tokens=60, block_size=10)
    c.put("a", 30, 0)
    c.put("b", 30, 0)
    assert c.pin("a") == (30, 0)
    assert c.pin("a") == (30, 0)  # a concurrent turn shares the blocks
    c.put("c", 30, 0)  # must evict: b, not the pinned (older) a
    assert c.peek("a") == (30, 0) and c.peek("b") is None
    c.release("a", 50, 1, pinned=True)
    assert c.peek("a") == (50, 1) and "a" in c.pinned
    c.release("a", 50, 1, pinned=True)
    assert "a" not in c.pinned and c.held == 0
    assert c.used <= 60


def test_published_blocks_are_reusable_before_their_request_ends():
    c = PrefixCache(limit_tokens=100, block_size=10)
    assert c.pin("a") is None  # a first turn: nothing cached
    c.publish("a", 45, 0, pinned=False)  # its prompt is computed; the request still runs
    assert c.pin("a") == (40, 0), "the next turn reuses whole blocks at once"
    assert c.held == 40 and c.used == 40
    c.release("a", 60, 0, pinned=True)  # the first request ends with its output
    c.release("a", 60, 0, pinned=True)  # and the second
    assert "a" not in c.pinned and c.peek("a") == (60, 0) and c.held == 0 and c.used == 60


def test_shrinking_the_limit_evicts():
    c = PrefixCache(limit_tokens=100, block_size=10)
    c.put("a", 100, 0)
    c.set_limit(35)
    assert c.peek("a") == (30, 0)


def test_usable_tokens_stop_at_a_rewrite_between_entry_and_prompt():
    # entry written at generation 0; the conversation was rewritten keeping 40 tokens
    assert usable_tokens(100, 0, 500, [40], gen=1) == 40
    assert usable_tokens(100, 1, 500, [40], gen=1) == 100  # written after the rewrite
    assert usable_tokens(100, 1, 70, [40], gen=1) == 70  # never more than the prompt shares
    # a generation-0 request opening after the rewrite: a generation-0 entry is all its own,
    # a generation-1 entry shares only what the rewrite kept
    assert usable_tokens(100, 0, 500, [40], gen=0) == 100
    assert usable_tokens(100, 1, 500, [40], gen=0) == 40
    assert usable_tokens(100, 0, 500, [60, 30, 80], gen=3) == 30  # the deepest cut between


def test_late_work_of_an_older_generation_keeps_the_newer_entry():
    """MD catching up on a turn the conversation has since rewritten (kept 40 tokens)
    lands after the newer turn: the newer stream stays cached, as vLLM's
    content-addressed blocks would."""
    divs = [40]
    c = PrefixCache(limit_tokens=1000, block_size=10)
    c.put("a", 70, 1, divs)  # generation 1's turn ended: 70 tokens of the new stream
    c.put("a", 300, 0, divs)  # the older turn's 300 tokens land late: only 40 are the new stream's
    assert c.peek("a") == (70, 1)
    c.put("a", 30, 1, divs)  # a shorter request of the same stream does not shrink it
    assert c.peek("a") == (70, 1)
    c.put("a", 20, 2, divs + [50])  # a newer rewrite kept 50: the new turn wrote only 20
    assert c.peek("a") == (50, 2), "the first 50 tokens are the same blocks"
    assert c.used == 50


def test_merge_goes_both_ways_across_rewrites():
    assert merged(300, 0, 70, 1, [40]) == (70, 1)
    assert merged(30, 0, 20, 1, [40]) == (30, 1)
    assert merged(70, 1, 300, 0, [40]) == (70, 1)
    assert merged(10, 1, 300, 0, [40]) == (40, 1)
    assert merged(60, 2, 300, 0, [90, 30]) == (60, 2)


# ---- a decoder's first step after a pull ------------------------------------------------


def _first_tokens(perf: FittedPerf, pulled: bool) -> tuple[float, float]:
    """A running sequence, and one more joining mid-step: when each produces its 4th / 1st token."""
    loop = Loop()
    inst = Instance(loop, "d", perf, max_seqs=8, max_batched=512, capacity=100_000, block_size=16)
    times: dict[str, float] = {}
    running = Seq("a", 100, 6, 106, inst.open("a", 0, (), 0), lambda seq, worst: times.setdefault("a", loop.now))
    inst.submit_decode(running)
    joining = Seq("b", 3000, 2, 3002, inst.open("b", 0, (), 0), lambda seq, worst: None, pulled)
    loop.at(0.025, lambda _: inst.submit_decode(joining))
    loop.run()
    return joining.t_first, times["a"]


def test_a_pulled_sequence_first_prefills_its_last_token_in_a_step_all_running_sequences_wait_for():
    perf = FittedPerf(a_ms=10.0, b_ms_per_prefill_token=1.0, c_ms_per_decode_seq=0.0, d_ms_per_kv_token=0.0, f_ms_per_prefix_chunk=8.0)
    # steps of 10 ms; b joins at the boundary at 30 ms
    assert _first_tokens(perf, pulled=False) == (pytest.approx(0.040), pytest.approx(0.060))
    # its first step is a one-token chunk after a prefix: 10 + 1 + 8 ms, and a's token in it waits as long
    assert _first_tokens(perf, pulled=True) == (pytest.approx(0.049), pytest.approx(0.069))


def test_a_model_pricing_a_one_token_chunk_as_a_decode_token_keeps_the_decode_stretch():
    perf = FittedPerf(a_ms=10.0, b_ms_per_prefill_token=0.5, c_ms_per_decode_seq=0.5, d_ms_per_kv_token=0.0)
    # steps of 10.5 ms alone, 11 ms with two; b joins at 31.5 ms
    assert _first_tokens(perf, pulled=True) == _first_tokens(perf, pulled=False) == (pytest.approx(0.0425), pytest.approx(0.064))


def test_mds_wait_is_two_decode_steps_of_its_running_batch_and_one_more_per_request_beyond_it():
    """policy.decoder_wait_ms of MD's decode step now (the conductor reads it off MD's streams): its batch as it
    runs, a lone sequence's when idle; and of its requests in flight (`streams`) against its batch limit."""
    loop = Loop()
    perf = FittedPerf(a_ms=10.0, b_ms_per_prefill_token=0.0, c_ms_per_decode_seq=1.0, d_ms_per_kv_token=0.01)
    inst = Instance(loop, "d", perf, max_seqs=2, max_batched=512, capacity=100_000, block_size=16)
    gaps = Gaps("a->b", ["d"], 0.0)
    assert gaps.md_wait_ms(inst) == pytest.approx(2 * 11.0)
    seqs = [Seq(name, ctx, 50, ctx + 50, inst.open(name, 0, (), 0), lambda seq, worst: None) for name, ctx in (("a", 100), ("b", 300))]
    inst.submit_decode(seqs[0])
    assert gaps.md_wait_ms(inst) == pytest.approx(2 * (10 + 1.0 + 100 * 0.01))
    inst.submit_decode(seqs[1])  # joins at a's first step's end (12 ms), a's context one token longer
    seen: list[float] = []
    loop.at(0.02, lambda _: seen.append(gaps.md_wait_ms(inst)))
    loop.run()
    assert seen == [pytest.approx(2 * (10 + 2 * 1.0 + 401 * 0.01))]
    for streams, steps in ((1, 2), (2, 3), (4, 5)):  # requests in flight there, the new one beyond the batch of 2 from 2 on
        inst.streams = streams
        assert gaps.md_wait_ms(inst) == pytest.approx(steps * 11.0)


# ---- links -----------------------------------------------------------------------------


def _link(loop: Loop, mbps: float = 8.0, rtt_ms: float = 0.0) -> Link:
    return Link(loop, LinkConfig(between=("a", "b"), bandwidth_mbps=mbps, rtt_ms=rtt_ms))


def test_two_concurrent_flows_each_get_half_the_bandwidth():
    loop = Loop()
    link = _link(loop)  # 8 Mb/s = 1e6 bytes/s
    done = {}
    link.send(1_000_000, lambda k: done.setdefault(k, loop.now), "x")
    link.send(1_000_000, lambda k: done.setdefault(k, loop.now), "y")
    loop.run()
    assert done["x"] == pytest.approx(2.0) and done["y"] == pytest.approx(2.0)
    assert link.bytes == 2_000_000


def test_processor_sharing_with_a_late_flow():
    loop = Loop()
    link = _link(loop)
    done = {}
    link.send(1_000_000, lambda k: done.setdefault(k, loop.now), "long")
    loop.at(0.5, lambda _: link.send(250_000, lambda k: done.setdefault(k, loop.now), "short"))
    loop.run()
    # alone for 0.5 s (500 kB), then half rate each: short needs 0.5 s, long has 250 kB left alone
    assert done["short"] == pytest.approx(1.0)
    assert done["long"] == pytest.approx(1.25)


def test_rtt_is_paid_before_the_bytes_and_empty_pulls_are_free():
    loop = Loop()
    link = _link(loop, rtt_ms=40)
    done = {}
    link.send(500_000, lambda k: done.setdefault(k, loop.now), "x")
    link.send(0, lambda k: done.setdefault(k, loop.now), "empty")
    loop.run()
    assert done == {"empty": 0.0, "x": pytest.approx(0.04 + 0.5)}
    assert link.transfers == 1


def test_an_engine_runs_its_pull_slots_and_queues_the_rest_in_order():
    loop = Loop()
    link = _link(loop, rtt_ms=40)  # 1e6 bytes/s
    slots = PullSlots(loop, 2)
    done = {}
    for name in ("a", "b", "c"):
        slots.pull(link, 1_000_000, lambda k: done.setdefault(k, loop.now), name)
    loop.run()
    # a and b share the link; c starts when they end and then has it alone (its own RTT first)
    assert done["a"] == pytest.approx(0.04 + 2.0) and done["b"] == pytest.approx(0.04 + 2.0)
    assert done["c"] == pytest.approx(0.04 + 2.0 + 0.04 + 1.0)
    assert slots.free == 2 and not slots.waiting


@pytest.mark.parametrize("order", list(PullOrder))
def test_a_freed_slot_takes_the_smallest_waiting_pull_or_the_oldest(order):
    loop = Loop()
    link = _link(loop, rtt_ms=40)  # 1e6 bytes/s
    slots = PullSlots(loop, 1, order)
    done = {}
    for name, nbytes in (("holder", 1_000_000), ("big", 3_000_000), ("small", 500_000), ("mid", 1_000_000)):
        slots.pull(link, nbytes, lambda k: done.setdefault(k, loop.now), name)
    loop.run()
    expected = ["holder", "small", "mid", "big"] if order is PullOrder.smallest_first else ["holder", "big", "small", "mid"]
    assert sorted(done, key=done.get) == expected
    # one at a time, each its own RTT and then the link alone
    assert max(done.values()) == pytest.approx(4 * 0.04 + 5.5)


def test_queued_pulls_finish_sooner_than_sharing_the_link_among_all():
    def ends(slots: int) -> list[float]:
        loop = Loop()
        link, pulls = _link(loop), PullSlots(loop, slots)
        out = []
        for _ in range(4):
            pulls.pull(link, 1_000_000, lambda _: out.append(loop.now), None)
        loop.run()
        return out

    assert ends(8) == pytest.approx([4.0] * 4)  # all four share: each ends at 4 s
    assert ends(1) == pytest.approx([1.0, 2.0, 3.0, 4.0])  # one at a time: same total, earlier on average


def test_a_pull_asks_for_its_slot_after_the_engine_processed_its_request():
    loop = Loop()
    link = _link(loop)
    slots = PullSlots(loop, 1)
    done = {}
    slots.pull(link, 500_000, lambda k: done.setdefault(k, loop.now), "late", after=0.3)
    slots.pull(link, 500_000, lambda k: done.setdefault(k, loop.now), "now")
    slots.pull(link, 0, lambda k: done.setdefault(k, loop.now), "empty", after=0.1)
    loop.run()
    # "now" holds the only slot from 0 to 0.5 s; "late" asks at 0.3 s and waits for it; an empty pull takes none
    assert done == {"empty": pytest.approx(0.1), "now": pytest.approx(0.5), "late": pytest.approx(1.0)}
    assert link.transfers == 2


def test_a_fast_link_with_many_flows_terminates():
    loop = Loop()
    link = _link(loop, mbps=3_200_000)
    ends = []
    for i in range(200):
        loop.at(i * 1e-4, lambda size: link.send(size, lambda _: ends.append(loop.now), None), 123_457 + i * 977)
    loop.run()
    assert len(ends) == 200
