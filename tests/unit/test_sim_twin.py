"""The twin end to end: closed-form cases, conservation, determinism, policy parity."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import app.policy
import app.sim.baselines
import app.sim.pdd
import app.sim.twin
from app.config import Mode, PDDConfig
from app.policy import GapCorrection, LinkFacts, Pipeline, RequestFacts, expected_transfer_ms
from app.sim import simulate
from app.sim.perf import FittedPerf
from app.sim.routing import KeyChain
from app.sim.workload import AgenticWorkload, Request

# Round figures so the closed-form cases can be written by hand.
FLOPS = 100e12  # 100 TFLOP/s, efficiency 1
BW = 1000e9  # 1 TB/s
FLOP_PER_TOKEN = 2e9  # 1B active parameters
WEIGHTS = 2e9  # 1B parameters x 2 bytes (dense: active == total)
ATTN = 1e6  # FLOPs per (query, key) pair
KVB = 1000  # KV bytes per token
BLOCK = 16
WAN_BPS = 1000e6 / 8  # 1 Gb/s
RTT = 0.020


def tiny_args(mode: str = "pdd") -> dict[str, Any]:
    spec = {"peak_tflops": FLOPS / 1e12, "memory_bandwidth_gbps": BW / 1e9, "memory_gib": 16}
    return {
        "mode": mode,
        "model": {
            "block_size": BLOCK,
            "max_model_len": 65536,
            "spec": {"active_params_b": 1, "weight_bytes_per_param": 2, "kv_bytes_per_token": KVB, "attention_flops_per_token_pair": ATTN},
        },
        "node_groups": {
            "a": {"datacenter": "dc-a", "accelerator": "X", "num_gpus": 1, "cost_per_hour": 2.0, "spec": spec},
            "b": {"datacenter": "dc-b", "accelerator": "Y", "num_gpus": 1, "cost_per_hour": 3.0, "spec": spec},
        },
        "roles": {
            "prefill": {"node_group": "a", "replicas": 1, "engine": {"max_num_batched_tokens": 8192}},
            "relay_decode": {"node_group": "a", "replicas": 1},
            "main_decode": {"node_group": "b", "replicas": 1},
        },
        "links": [
            {"between": ["dc-a", "dc-a"], "bandwidth_mbps": 100_000, "rtt_ms": 0.1},
            {"between": ["dc-a", "dc-b"], "bandwidth_mbps": WAN_BPS * 8 / 1e6, "rtt_ms": RTT * 1000},
        ],
        "slo": {"ttft_ms": 2000, "tpot_ms": 100, "max_gap_ms": 2000},
    }


def tiny_config(mode: str = "pdd", **changes: Any) -> PDDConfig:
    args = tiny_args(mode)
    for path, value in changes.items():
        node = args
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return PDDConfig.model_validate(args)


def prefill_s(tokens: int, ctx: int = 0) -> float:
    pairs = tokens * ctx + tokens * (tokens + 1) / 2
    compute = (tokens * FLOP_PER_TOKEN + pairs * ATTN) / FLOPS
    memory = (WEIGHTS + (ctx + tokens) * KVB) / BW
    return max(compute, memory)


def decode_s(ctx: int) -> float:
    """One decode step of a lone sequence attending to `ctx` tokens (memory-bound here)."""
    return max((FLOP_PER_TOKEN + ctx * ATTN) / FLOPS, (WEIGHTS + ctx * KVB) / BW)


def only(run) -> Any:
    (r,) = run.records()
    return r


# ---- closed-form cases: one request on idle instances and idle links ---------------------


def test_colocated_one_request_by_hand():
    r = only(simulate(tiny_config("colocated"), [Request(0.0, "s", 1000, 0, 4)]))
    assert r.pipeline is Pipeline.colocated
    assert r.ttft_s == pytest.approx(prefill_s(1000), rel=1e-12)
    # the three decode steps attend to 1001, 1002, 1003 tokens
    assert r.tpot_s == pytest.approx((decode_s(1001) + decode_s(1002) + decode_s(1003)) / 3, rel=1e-12)
    assert r.max_gap_s == pytest.approx(decode_s(1003), rel=1e-12)


def test_models_by_role_come_before_models_by_node_group():
    """A model fitted to one role's engine applies to that role alone (its host-mates get theirs)."""
    prefill_model, group_a, group_b = FittedPerf(50.0, 0, 0, 0), FittedPerf(7.0, 0, 0, 0), FittedPerf(3.0, 0, 0, 0)
    r = only(simulate(tiny_config("pdd"), [Request(0.0, "s", 100, 0, 1)], {"prefill": prefill_model, "a": group_a, "b": group_b}))
    assert r.ttft_s == pytest.approx(0.050, rel=1e-9)  # one prefill step on P: the role's model, not group a's
    r = only(simulate(tiny_config("colocated"), [Request(0.0, "s", 100, 0, 3)], {"prefill": prefill_model, "a": group_a, "b": group_b}))
    assert (r.ttft_s, r.tpot_s) == (pytest.approx(0.003), pytest.approx(0.003))  # colocated serves on main decode: group b


@pytest.mark.parametrize("mode", ["colocated", "pdd", "pd_intra_dc", "pd_cross_dc_naive", "pd_cross_dc"])
def test_the_entry_roles_serving_overhead_delays_every_token_once(mode):
    """The conductor, RPC and the engines' input and output processing: time outside the steps, paid once per request."""
    models = {"prefill": FittedPerf(5.0, 0.01, 0, 0), "relay_decode": FittedPerf(2.0, 0, 0.1, 0), "main_decode": FittedPerf(3.0, 0.01, 0.1, 0)}
    entry = "main_decode" if mode == "colocated" else "prefill"
    slow = {**models, entry: replace(models[entry], serving_overhead_ms=20.0)}
    other = "prefill" if mode == "colocated" else "main_decode"
    ignored = {**models, other: replace(models[other], serving_overhead_ms=20.0)}  # only the entry role's counts
    # two turns of one session, the second after the first ends: the delay shifts it whole, as it shifts the first
    reqs = [Request(0.0, "s", 1000, 0, 8), Request(5.0, "s", 1100, 1008, 8)]
    base, delayed, same = (simulate(tiny_config(mode), reqs, m).records() for m in (models, slow, ignored))
    for b, d, o in zip(base, delayed, same):
        assert d.ttft_s == pytest.approx(b.ttft_s + 0.020, rel=1e-9)
        assert (d.tpot_s, d.max_gap_s, d.pipeline) == (pytest.approx(b.tpot_s, rel=1e-9), pytest.approx(b.max_gap_s, rel=1e-9), b.pipeline)
        assert (o.ttft_s, o.tpot_s) == (pytest.approx(b.ttft_s, rel=1e-9), pytest.approx(b.tpot_s, rel=1e-9))


def test_the_serving_overhead_grows_with_the_requests_in_flight_on_arrival():
    """The conductor and the replicas stream the tokens of the requests in flight on the same CPUs as the next request's way in."""
    models = {"prefill": FittedPerf(5.0, 0.01, 0, 0), "relay_decode": FittedPerf(2.0, 0, 0.1, 0), "main_decode": FittedPerf(3.0, 0.01, 0.1, 0)}
    loaded = {**models, "prefill": replace(models["prefill"], serving_overhead_ms=5.0, serving_overhead_ms_per_in_flight=20.0)}
    # a long answer; another conversation's turn while it decodes (P idle again); a third after both ended
    reqs = [Request(0.0, "a", 1000, 0, 400), Request(0.5, "b", 800, 0, 4), Request(60.0, "c", 900, 0, 4)]
    base, delayed = (simulate(tiny_config("pdd"), reqs, m).records() for m in (models, loaded))
    assert base[0].ttft_s + base[0].tpot_s * 399 > 0.5  # the first is still in flight when the second arrives
    assert [d.ttft_s - b.ttft_s for b, d in zip(base, delayed)] == [pytest.approx(0.005), pytest.approx(0.025), pytest.approx(0.005)]


def test_every_pull_pays_the_kv_transport_and_its_bytes_where_the_link_is_faster():
    """The entry role's model carries the KV connector's own cost per pull; a link slower than it paces the bytes itself."""
    models = {"prefill": FittedPerf(5.0, 0.01, 0, 0), "relay_decode": FittedPerf(2.0, 0, 0.1, 0), "main_decode": FittedPerf(3.0, 0.01, 0.1, 0)}
    costly = {**models, "prefill": replace(models["prefill"], kv_pull_ms=3.0, kv_pull_ms_per_mb=2.0)}  # 500 MB/s: under 100 Gbit/s, over 1 Gbit/s
    reqs = [Request(0.0, "s", 1000, 0, 8)]
    pulled = math.ceil(1000 / BLOCK) * BLOCK * KVB / 1e6  # MB of the prompt's blocks, the last one part-filled
    # P-D inside dc-a: the decoder's first token, the request's second, comes later by the whole cost
    base, slow = (only(simulate(tiny_config("pd_intra_dc"), reqs, m)) for m in (models, costly))
    assert slow.ttft_s == pytest.approx(base.ttft_s, rel=1e-9)
    assert slow.max_gap_s - base.max_gap_s == pytest.approx((3.0 + 2.0 * pulled) / 1000, rel=1e-9)
    # naive P-D across the WAN, which is slower than the transport: the first token waits the cost per pull only
    base, slow = (only(simulate(tiny_config("pd_cross_dc_naive"), reqs, m)) for m in (models, costly))
    assert slow.ttft_s - base.ttft_s == pytest.approx(0.003, rel=1e-9)


@pytest.mark.parametrize(("mode", "delays_the_second_token"), [("pd_intra_dc", True), ("pd_cross_dc_naive", False)])
def test_a_decoder_replicas_own_time_delays_each_request_it_gets_after_ps_first_token(mode, delays_the_second_token):
    """Not the naive decoder's: its replica is on the first token's way, which the serving overhead counts."""
    models = {"prefill": FittedPerf(5.0, 0.01, 0, 0), "relay_decode": FittedPerf(2.0, 0, 0.1, 0), "main_decode": FittedPerf(3.0, 0.01, 0.1, 0)}
    slow = {**models, "prefill": replace(models["prefill"], decoder_request_overhead_ms=7.0)}
    base, delayed = (only(simulate(tiny_config(mode), [Request(0.0, "s", 1000, 0, 8)], m)) for m in (models, slow))
    assert delayed.ttft_s == pytest.approx(base.ttft_s, rel=1e-9)
    assert delayed.max_gap_s - base.max_gap_s == pytest.approx(0.007 if delays_the_second_token else 0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("mode", "routing", "pipeline"), [("pd_intra_dc", {}, Pipeline.p_d), ("pdd", {}, Pipeline.p_md), ("pdd", {"max_wan_transfer_ms": 1}, Pipeline.p_rld_md)]
)
def test_a_decoders_first_step_after_its_pull_is_a_chunk_after_a_prefix(mode, routing, pipeline):
    """The decoder computes the prompt's last token itself: its first step pays the cost per chunk after a prefix."""

    def gap(f_ms: float) -> float:
        decoder = FittedPerf(2.0, 0.01, 0.1, 0, f_ms_per_prefix_chunk=f_ms)
        models = {"prefill": FittedPerf(5.0, 0.01, 0, 0), "relay_decode": decoder, "main_decode": decoder}
        r = only(simulate(tiny_config(mode, routing=routing), [Request(0.0, "s", 1000, 0, 8)], models))
        assert r.pipeline is pipeline
        return r.max_gap_s

    assert gap(8.0) - gap(0.0) == pytest.approx(0.008, abs=1e-12)


def test_each_prefill_chunk_after_a_prefix_pays_the_models_cost_per_chunk():
    plain = FittedPerf(2.0, 0.01, 0.1, 0.0001)
    config = tiny_config("colocated", roles__main_decode__engine={"max_num_batched_tokens": 512})
    # three chunks, the second and third after the first; then a turn after its cached conversation
    reqs = [Request(0.0, "s", 1200, 0, 2), Request(10.0, "s", 1300, 1202, 2)]
    base, costly = (simulate(config, reqs, {"main_decode": m}).records() for m in (plain, replace(plain, f_ms_per_prefix_chunk=7.0)))
    assert costly[0].ttft_s - base[0].ttft_s == pytest.approx(0.014)
    assert costly[1].ttft_s - base[1].ttft_s == pytest.approx(0.007)
    assert (costly[0].tpot_s, costly[1].tpot_s) == (pytest.approx(base[0].tpot_s), pytest.approx(base[1].tpot_s))  # decodes do not


def test_chunked_prefill_by_hand():
    config = tiny_config("colocated", roles__main_decode__engine={"max_num_batched_tokens": 512})
    r = only(simulate(config, [Request(0.0, "s", 1200, 0, 1)]))
    assert r.ttft_s == pytest.approx(prefill_s(512) + prefill_s(512, 512) + prefill_s(176, 1024), rel=1e-12)


def test_p_md_one_request_transfer_by_hand():
    r = only(simulate(tiny_config("pdd"), [Request(0.0, "s", 1000, 0, 4)]))
    assert r.pipeline is Pipeline.p_md
    blocks = math.ceil(1000 / BLOCK)
    transfer = RTT + blocks * BLOCK * KVB / WAN_BPS
    assert r.wan_bytes == blocks * BLOCK * KVB
    assert r.ttft_s == pytest.approx(prefill_s(1000), rel=1e-12)
    # token 2 from MD: after the WAN pull and one decode step, plus half an RTT to the client
    assert r.max_gap_s == pytest.approx(transfer + decode_s(1001) + RTT / 2, rel=1e-9)
    decode = decode_s(1001) + decode_s(1002) + decode_s(1003)
    assert r.tpot_s == pytest.approx((transfer + decode + RTT / 2) / 3, rel=1e-9)


def test_naive_cross_dc_first_token_waits_for_the_whole_kv():
    r = only(simulate(tiny_config("pd_cross_dc_naive"), [Request(0.0, "s", 1000, 0, 3)]))
    assert r.pipeline is Pipeline.p_d_naive
    transfer = RTT + math.ceil(1000 / BLOCK) * BLOCK * KVB / WAN_BPS
    # the decoder computes token 1's KV (producing token 2), then both reach the client
    assert r.ttft_s == pytest.approx(prefill_s(1000) + transfer + prefill_s(1, 1000) + RTT / 2, rel=1e-9)


def test_pd_intra_dc_pulls_over_the_intra_link():
    r = only(simulate(tiny_config("pd_intra_dc"), [Request(0.0, "s", 1000, 0, 2)]))
    assert r.pipeline is Pipeline.p_d and r.wan_bytes == 0
    intra = 0.0001 + math.ceil(1000 / BLOCK) * BLOCK * KVB / (100_000e6 / 8)
    assert r.max_gap_s == pytest.approx(intra + decode_s(1001), rel=1e-9)


# ---- PDD behaviour ----------------------------------------------------------------------


def test_relay_masks_a_long_transfer_and_hands_over():
    # a 1 ms threshold forces the relay; a slow WAN makes the relay produce many eager tokens
    slow_wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 1}, handoff={"mode": "one_shot", "relay_cap_tokens": 4000}, links=slow_wan)
    r = only(simulate(config, [Request(0.0, "s", 4000, 0, 1200)]))
    assert r.pipeline is Pipeline.p_rld_md
    assert 0 < r.relay_tokens < 1199
    transfer = 0.02 + math.ceil(4000 / BLOCK) * BLOCK * KVB / (20e6 / 8)
    assert r.max_gap_s < transfer / 5  # the relay hid the transfer from the stream
    # a cap below what the transfer needs: RLD stops and the stream waits for MD
    capped = tiny_config("pdd", routing={"max_wan_transfer_ms": 1}, handoff={"mode": "one_shot", "relay_cap_tokens": 100}, links=slow_wan)
    c = only(simulate(capped, [Request(0.0, "s", 4000, 0, 1200)]))
    assert c.relay_tokens == 100 and c.max_gap_s > transfer / 2


def test_at_its_cap_the_relay_ends_its_request():
    # relay.py aborts RLD's request at the cap: the cap bounds what one request costs the relay
    slow_wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 1}, handoff={"mode": "one_shot", "relay_cap_tokens": 100}, links=slow_wan)
    twin = app.sim.twin.Twin(config)
    (r,) = twin.run([Request(0.0, "s", 4000, 0, 1200)]).records()
    assert r.relay_tokens == 100
    rld = twin.R[0]
    assert rld.decode_tokens == 100  # none computed past the cap
    assert rld.streams == 0 and twin.M[0].streams == 0 and twin.P[0].streams == 0


def test_a_request_the_relay_finishes_still_brings_main_decode_the_whole_turn():
    slow_wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 1}, links=slow_wan)
    twin = app.sim.twin.Twin(config)
    (r,) = twin.run([Request(0.0, "s", 4000, 0, 20)]).records()
    assert r.pipeline is Pipeline.p_rld_md and r.relay_tokens == 19  # the whole output came from RLD
    md = twin.M[0]
    # MD's warm-up landed after the request ended, then MD extended over the relay's
    # tokens: its cache and the index hold the prompt and the answer
    turn = 4000 + 20
    assert md.cache.peek("s")[0] == turn // BLOCK * BLOCK
    assert md.streams == 0
    conv = twin.sessions["s"].conv
    turn_keys = KeyChain(tuple(conv.segs), conv.blocks).head(turn // BLOCK)
    assert twin.index.estimate(md.name, turn_keys) == turn // BLOCK * BLOCK


def test_a_decoder_runs_as_many_pulls_at_once_as_it_has_pull_threads():
    wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]

    def ttfts(concurrent_pulls: int) -> list[float]:
        config = tiny_config("pd_cross_dc_naive", links=wan, kv={"concurrent_pulls": concurrent_pulls})
        return sorted(r.ttft_s for r in simulate(config, [Request(0.0, "s", 4000, 0, 4), Request(0.0, "t", 4000, 0, 4)]).records())

    pull_s = 0.02 + 4000 * KVB / 2.5e6  # RTT, then 4 MB at 20 Mbit/s
    shared, in_turn = ttfts(8), ttfts(1)
    # sharing the WAN, both pulls end together, a prefill apart; in turn, the first ends a whole pull sooner
    assert shared[1] - shared[0] == pytest.approx(prefill_s(4000), rel=0.05)
    assert in_turn[1] - in_turn[0] == pytest.approx(pull_s, rel=0.01)
    assert in_turn[1] == pytest.approx(shared[1], rel=0.01)


@pytest.mark.parametrize("order", ["smallest_first", "arrival"])
def test_a_decoders_free_pull_thread_takes_the_waiting_pull_its_pull_order_names(order):
    wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]
    config = tiny_config("pd_cross_dc_naive", links=wan, kv={"concurrent_pulls": 1, "pull_order": order})
    # "s" holds the only pull thread for 1.6 s; "large" and then "small" are prefilled meanwhile and wait
    requests = [Request(0.0, "s", 4000, 0, 4), Request(0.3, "large", 4000, 0, 4), Request(0.4, "small", 400, 0, 4)]
    ttft = {requests[r.rid].session: r.arrival_s + r.ttft_s for r in simulate(config, requests).records()}
    pull_s = {n: 0.02 + n * KVB / 2.5e6 for n in (400, 4000)}
    first, then = ("small", "large") if order == "smallest_first" else ("large", "small")
    assert ttft[then] - ttft[first] == pytest.approx(pull_s[4000 if then == "large" else 400], rel=0.05)


@pytest.mark.parametrize("timeout_s", [120.0, 0.05])
def test_a_next_turn_waits_for_main_decode_to_finish_the_last_one_rather_than_pull_it_again(timeout_s):
    slow_wan = [tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}]
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 1}, links=slow_wan, kv={"transfer_timeout_s": timeout_s})
    # turn 1 ends on the relay while MD still pulls its 4 MB (1.6 s); turn 2 goes out at once
    first, second = simulate(config, [Request(0.0, "s", 4000, 0, 20), Request(0.0, "s", 4100, 4020, 20)]).records()
    assert first.relay_tokens == 19 and second.pipeline is Pipeline.p_rld_md
    assert first.wan_bytes == app.policy.blocks_missing(4000, 0, BLOCK) * BLOCK * KVB  # moved after it ended
    held = (4000 + 20) // BLOCK * BLOCK if timeout_s > 2 else 0  # what MD holds when turn 2's pull starts
    assert second.wan_bytes == app.policy.blocks_missing(4100, held, BLOCK) * BLOCK * KVB
    assert second.decode_hit_tokens == held  # MD's hit, though MD opened after the relay finished turn 2


def test_catch_up_rounds_go_through_policy(monkeypatch):
    """The twin's relay runs the conductor's RelayMachine, which asks policy for each step."""
    steps = []
    real = app.policy.next_handoff_step

    def spy(pending, rounds, mode, handoff):
        step = real(pending, rounds, mode, handoff)
        steps.append((pending, rounds, mode.value, step.value))
        return step

    monkeypatch.setattr(app.policy, "next_handoff_step", spy)
    config = tiny_config(
        "pdd",
        routing={"max_wan_transfer_ms": 1},
        handoff={"mode": "catch_up", "catch_up_threshold_tokens": 8, "relay_cap_tokens": 4000},
        links=[tiny_args()["links"][0], {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 20, "rtt_ms": 20}],
    )
    r = only(simulate(config, [Request(0.0, "s", 4000, 0, 2000)]))
    assert r.pipeline is Pipeline.p_rld_md
    assert steps[0][3] == "catch_up" and steps[-1][3] == "final"
    assert [s[1] for s in steps] == list(range(len(steps)))


def test_singular_filter_finishes_on_the_relay():
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 1, "singular": {"min_prompt_tokens": 2000, "max_output_tokens": 8}})
    run = simulate(config, [Request(0.0, "s", 4000, 0, 4), Request(0.0, "t", 4000, 0, 40)])
    pipes = {r.output_tokens: r.pipeline for r in run.records()}
    assert pipes == {4: Pipeline.p_rld, 40: Pipeline.p_rld_md}


def test_decode_side_cache_cuts_wan_bytes_on_follow_up_turns():
    turns = [Request(0.0, "s", 8000, 0, 100), Request(30.0, "s", 8300, 8100, 100)]
    pdd, cross = (simulate(tiny_config(mode), turns).records() for mode in ("pdd", "pd_cross_dc"))
    naive = simulate(tiny_config("pd_cross_dc_naive"), turns).records()
    # MD holds turn 1's prompt and output: only the new tail's blocks cross, in PDD and in vLLM's cross-DC PD alike
    for run in (pdd, cross):
        assert run[1].decode_hit_tokens == 8096
        assert run[1].wan_bytes == math.ceil((8300 - 8096) / BLOCK) * BLOCK * KVB
        assert run[1].prefill_hit_tokens == 8000  # P held the previous prompt only
    assert naive[1].wan_bytes == math.ceil(8300 / BLOCK) * BLOCK * KVB
    assert [r.pipeline for r in cross] == [Pipeline.p_d_cross] * 2
    # the first token waits for the decoder in both cross-DC PDs, for all the prompt's KV in the naive one
    assert cross[1].ttft_s < naive[1].ttft_s and cross[1].ttft_s > pdd[1].ttft_s


# ---- conservation and determinism -------------------------------------------------------

requests_st = st.lists(
    st.tuples(st.floats(0, 20), st.integers(0, 4), st.integers(1, 20_000), st.floats(0, 1), st.integers(1, 700)),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("mode", [m.value for m in Mode])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=requests_st, handoff=st.sampled_from(["one_shot", "catch_up", "auto"]), threshold=st.sampled_from([1, 300, 5000]))
def test_every_request_finishes_exactly_once(mode, raw, handoff, threshold):
    reqs = [Request(t, s, p, int(h * p), o) for t, s, p, h, o in sorted(raw)]
    config = tiny_config(
        mode,
        routing={"max_wan_transfer_ms": threshold},
        handoff={"mode": handoff, "catch_up_threshold_tokens": 4, "relay_cap_tokens": 64},
        roles__main_decode__engine={"max_num_seqs": 3, "kv_cache_gib": 1},
    )
    run = simulate(config, reqs)
    a = run.results.arrays()
    assert sorted(a["rid"].tolist()) == list(range(len(reqs)))
    assert np.all(a["ttft"] > 0) and np.all(a["gap"] >= 0)
    assert np.all(a["last"] >= a["arrival"] + a["ttft"] - 1e-12)
    for inst in [i for pool in _pools(config, reqs) for i in pool]:
        assert inst.n == 0 and inst.reserved == 0 and inst.active == 0 and not inst.prefill_q


def _pools(config, reqs):
    twin = app.sim.twin.Twin(config)
    twin.run(reqs)
    return twin.cluster.pools.values()


def test_same_seed_same_run_other_seed_other_draws():
    config = tiny_config(
        "pdd",
        links=[
            tiny_args()["links"][0],
            {"between": ["dc-a", "dc-b"], "bandwidth_mbps": 1000, "rtt_ms": 20, "jitter": {"distribution": "exponential", "mean_ms": 30}},
        ],
    )
    w = AgenticWorkload(requests=300, rps=2, seed=7, first_prompt_median=3000, max_context_tokens=16000, think_time_min_s=1, think_time_mean_s=2)
    a = simulate(config, w, seed=1).results.arrays()
    b = simulate(config, w, seed=1).results.arrays()
    c = simulate(config, w, seed=2).results.arrays()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["gap"], c["gap"])


def test_workload_generator_is_seeded():
    w = AgenticWorkload(requests=500, rps=3, seed=11)
    assert list(w.generate()) == list(w.generate())
    assert list(w.generate()) != list(w.model_copy(update={"seed": 12}).generate())


# ---- policy parity ----------------------------------------------------------------------


def test_twin_calls_the_policy_module_itself():
    for name in ("choose_pipeline", "blocks_missing", "RelayMachine"):
        assert getattr(app.sim.pdd, name) is getattr(app.policy, name)
    assert app.sim.baselines.blocks_missing is app.policy.blocks_missing


def test_policy_swapped_in_changes_the_twin(monkeypatch):
    real = app.policy.choose_pipeline

    def always_relay(req, cluster, routing):
        d = real(req, cluster, routing)
        return type(d)(Pipeline.p_rld_md, d.blocks_to_send, d.expected_wan_ms, d.md_hit_rate, "forced")

    monkeypatch.setattr(app.sim.pdd, "choose_pipeline", always_relay)
    run = simulate(tiny_config("pdd"), [Request(0.0, "s", 500, 0, 50)])
    assert only(run).pipeline is Pipeline.p_rld_md


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=requests_st, threshold=st.floats(0, 400), min_hit=st.one_of(st.none(), st.floats(0, 1)))
def test_pipeline_choices_equal_policy_on_the_same_facts(monkeypatch, raw, threshold, min_hit):
    calls = []
    real = app.policy.choose_pipeline

    def record(req, cluster, routing):
        d = real(req, cluster, routing)
        calls.append((req, cluster, routing, d))
        return d

    monkeypatch.setattr(app.sim.pdd, "choose_pipeline", record)
    reqs = [Request(t, s, p, int(h * p), o) for t, s, p, h, o in sorted(raw)]
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": threshold, "min_hit_rate": min_hit})
    records = simulate(config, reqs).records()
    assert len(calls) == len(records)
    for (req, cluster, routing, decision), rec in zip(calls, records):
        # the facts are the request's and the cluster's, and the twin took the decision as made
        # (MD's expected prefix is the index's estimate: tests/unit/test_sim_routing.py)
        assert (req.prompt_tokens, req.max_tokens) == (rec.prompt_tokens, rec.output_tokens)
        assert cluster.block_size == BLOCK and cluster.kv_bytes_per_block == BLOCK * KVB
        assert cluster.wan.bandwidth_bytes_per_s == pytest.approx(WAN_BPS) and cluster.wan.rtt_s == pytest.approx(RTT)
        assert real(req, cluster, routing).pipeline is decision.pipeline is rec.pipeline
        # MD's wait is part of the gap: two steps of at least a lone sequence's (2 ms here); none without a main decoder
        assert cluster.md_wait_ms >= 2 * decode_s(0) if cluster.md_available else cluster.md_wait_ms == 0


def test_a_pull_on_the_wan_delays_the_next_request_as_the_conductor_counts_it():
    # a lone 1000-token pull: 28 ms; then MD's wait, two 2-ms steps; its token's way back, 10 ms; what a's gap taught, ~0
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 46})
    apart = simulate(config, [Request(0.0, "a", 1000, 0, 4), Request(1.0, "b", 1000, 0, 4)])
    assert [r.pipeline for r in apart.records()] == [Pipeline.p_md, Pipeline.p_md]
    # b is routed 1 ms after a's pull began: ~7 ms of it are still queued on the WAN
    behind = simulate(config, [Request(0.0, "a", 1000, 0, 4), Request(prefill_s(1000) + 0.001, "b", 1000, 0, 4)])
    assert [r.pipeline for r in behind.records()] == [Pipeline.p_md, Pipeline.p_rld_md]


def test_what_a_pull_did_not_move_leaves_the_wan_backlog_when_it_lands(monkeypatch):
    """Routing expects a's pull to move ten times what MD lacks (as when MD's cache holds more
    than the index knows): the rest counts as queued until the pull lands, as in the conductor."""
    real = app.policy.choose_pipeline

    def overestimate_a(req, cluster, routing):
        d = real(req, cluster, routing)
        return replace(d, blocks_to_send=d.blocks_to_send * 10) if req.max_tokens == 4 else d

    monkeypatch.setattr(app.sim.pdd, "choose_pipeline", overestimate_a)
    # a's real pull: 28 ms; its estimate: 100 ms; MD's wait, the token's way back and a's correction: ~14 ms more
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 46})
    pull_starts = prefill_s(1000)
    for b_after_s, b_pipeline in ((0.010, Pipeline.p_rld_md), (0.050, Pipeline.p_md)):
        run = simulate(config, [Request(0.0, "a", 1000, 0, 4), Request(pull_starts + b_after_s, "b", 1000, 0, 5)])
        assert [r.pipeline for r in run.records()] == [Pipeline.p_md, b_pipeline], b_after_s


def _record_facts(monkeypatch) -> list[tuple[Any, Any]]:
    """(ClusterFacts, RouteDecision) of each routing decision the twin makes, in order."""
    calls = []
    real = app.policy.choose_pipeline

    def record(req, cluster, routing):
        d = real(req, cluster, routing)
        calls.append((cluster, d))
        return d

    monkeypatch.setattr(app.sim.pdd, "choose_pipeline", record)
    return calls


#: What a lone 1000-token prompt's pull over the tiny WAN is predicted to take: 28 ms.
PULL_1000_MS = expected_transfer_ms(math.ceil(1000 / BLOCK), BLOCK * KVB, LinkFacts(WAN_BPS, RTT))


@pytest.mark.parametrize(("md_step_ms", "pipeline"), [(5.0, Pipeline.p_md), (20.0, Pipeline.p_rld_md)])
def test_mds_wait_for_its_steps_sends_a_turn_the_pull_alone_allows_to_the_relay(monkeypatch, md_step_ms, pipeline):
    """The gap routing predicts is the conductor's: the pull, then MD's wait (policy.decoder_wait_ms, the step it is in
    and the extend step) at MD's step time, then its token's way back. The pull alone fits the threshold either way."""
    facts = _record_facts(monkeypatch)
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": PULL_1000_MS + 30})
    r = only(simulate(config, [Request(0.0, "s", 1000, 0, 8)], {"main_decode": FittedPerf(md_step_ms, 0, 0, 0)}))
    ((cluster, decision),) = facts
    assert cluster.md_wait_ms == pytest.approx(2 * md_step_ms, rel=1e-12)
    assert decision.predicted_gap_ms == pytest.approx(PULL_1000_MS + 2 * md_step_ms + RTT * 500, rel=1e-12)
    assert r.pipeline is pipeline
    zero_wait = app.policy.choose_pipeline(RequestFacts(1000, 8, 0), replace(cluster, md_wait_ms=0.0), config.routing)
    assert zero_wait.pipeline is Pipeline.p_md


@pytest.mark.parametrize(("max_num_seqs", "b_waits_steps"), [(1, 3), (8, 2)])
def test_a_turn_beyond_mds_batch_waits_a_step_more_for_each_request_ahead(monkeypatch, max_num_seqs, b_waits_steps):
    """MD's requests in flight (the conductor's load) against its batch limit: a's turn still decodes on MD when b is routed."""
    facts = _record_facts(monkeypatch)
    config = tiny_config("pdd", roles__main_decode__engine={"max_num_seqs": max_num_seqs})
    reqs = [Request(0.0, "a", 1000, 0, 400), Request(0.5, "b", 1000, 0, 8)]
    run = simulate(config, reqs, {"main_decode": FittedPerf(5.0, 0, 0, 0)})
    assert run.records()[0].ttft_s + 399 * run.records()[0].tpot_s > 0.5  # a is in flight on MD when b is routed
    assert [c.md_wait_ms for c, _ in facts] == [pytest.approx(10.0), pytest.approx(5.0 * b_waits_steps)]


SLOW_PULLS = {"prefill": FittedPerf(5.0, 0.01, 0, 0, kv_pull_ms=300.0)}
"""Each pull costs the KV transport 300 ms beyond its link: gaps routing's prediction (pull + MD's wait) misses."""
GAP_KEY = "dc-a->dc-b|main_decode-0"
"""The conductor's key of a correction (app/conductor/gaps.py): the WAN's direction, then the MD replica."""


def test_a_correction_learned_from_a_slow_p_md_gap_sends_later_turns_to_the_relay_until_it_decays(monkeypatch):
    """The twin runs the conductor's GapCorrection: a P-MD turn's gap, seen when MD's first token reaches the
    conductor (a still decodes then), against its prediction without correction; read back at routing time."""
    facts = _record_facts(monkeypatch)
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 70})
    # a's answer is long: b is routed after a's MD token came but before a ends; c four minutes on, d after c's gap
    reqs = [Request(0.0, "a", 1000, 0, 2000), Request(1.0, "b", 1000, 0, 8), Request(240.0, "c", 1000, 0, 8), Request(241.0, "d", 1000, 0, 8)]
    twin = app.sim.twin.Twin(config, SLOW_PULLS)
    a, b, c, d = twin.run(reqs).records()
    assert a.arrival_s + a.ttft_s + a.max_gap_s < b.arrival_s < a.arrival_s + a.ttft_s + 1999 * a.tpot_s
    (a_facts, a_decision), (b_facts, _), (c_facts, c_decision), (d_facts, _) = facts
    assert a_facts.gap_correction_ms == 0.0 and a.pipeline is Pipeline.p_md
    assert a.max_gap_s > 0.3  # a's gap (MD's first token) took the transport's 300 ms the prediction lacks
    # what the conductor learns from a: its gap as seen, against pull + MD's wait, at the time MD's token came
    expected = GapCorrection()
    seen_at = a.arrival_s + a.ttft_s + a.max_gap_s
    expected.observe(GAP_KEY, a_decision.uncorrected_gap_ms, a.max_gap_s * 1000, seen_at)
    assert b_facts.gap_correction_ms == pytest.approx(expected.value(GAP_KEY, 1.0), rel=1e-9)
    assert b_facts.gap_correction_ms > 70 - PULL_1000_MS
    assert b.pipeline is Pipeline.p_rld_md  # the relay masks the gap the correction predicts
    # nothing corrects it while turns go to the relay: it decays, and P-MD comes back
    assert c_facts.gap_correction_ms == pytest.approx(expected.value(GAP_KEY, 240.0), rel=1e-9)
    assert c.pipeline is Pipeline.p_md and c_decision.predicted_gap_ms <= 70
    # c's slow gap teaches it again, against c's prediction without the correction c was routed with
    expected.observe(GAP_KEY, c_decision.uncorrected_gap_ms, c.max_gap_s * 1000, c.arrival_s + c.ttft_s + c.max_gap_s)
    assert d_facts.gap_correction_ms == pytest.approx(expected.value(GAP_KEY, 241.0), rel=1e-9)
    assert d.pipeline is Pipeline.p_rld_md
    assert twin.gaps.correction.value(GAP_KEY, 241.0) == pytest.approx(expected.value(GAP_KEY, 241.0), rel=1e-9)  # the conductor's key


def test_without_the_slow_pulls_the_same_turns_all_go_p_md():
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 60})
    reqs = [Request(0.0, "a", 1000, 0, 2000), Request(1.0, "b", 1000, 0, 8), Request(240.0, "c", 1000, 0, 8)]
    assert [r.pipeline for r in simulate(config, reqs, {"prefill": FittedPerf(5.0, 0.01, 0, 0)}).records()] == [Pipeline.p_md] * 3


def test_each_main_decoder_has_its_own_correction(monkeypatch):
    """b goes to the other MD (a's still decodes): what a's slow gap taught is about a's MD, not b's."""
    facts = _record_facts(monkeypatch)
    config = tiny_config("pdd", routing={"max_wan_transfer_ms": 60}, roles__main_decode__replicas=2)
    a, b = simulate(config, [Request(0.0, "a", 1000, 0, 2000), Request(1.0, "b", 1000, 0, 8)], SLOW_PULLS).records()
    assert a.arrival_s + a.ttft_s + a.max_gap_s < b.arrival_s  # a's slow gap was seen before b was routed
    assert [f.gap_correction_ms for f, _ in facts] == [0.0, 0.0]
    assert a.pipeline is b.pipeline is Pipeline.p_md


def test_tiny_config_is_valid_in_every_mode():
    for mode in Mode:
        assert tiny_config(mode.value).mode is mode
    assert copy.deepcopy(tiny_args()) == tiny_args()
