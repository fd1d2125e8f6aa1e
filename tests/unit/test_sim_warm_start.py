"""The twin's warm start: conversations under way when a run starts find their context cached."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.sim import Request, simulate
from app.sim.run import TimedTraffic
from app.sim.twin import Twin
from tests.unit.test_sim_run import SMALL
from tests.unit.test_sim_twin import BLOCK, KVB, prefill_s, tiny_config

PREFIX = 1600  # 100 blocks


@pytest.mark.parametrize(
    "mode, decoder_reuses_its_cache",
    [
        ("pdd", True),
        ("pd_intra_dc", True),
        ("colocated", True),
        ("pd_cross_dc_naive", False),
    ],
)
def test_a_conversation_under_way_finds_its_prefix_where_its_turns_are_routed(mode, decoder_reuses_its_cache):
    turn = [Request(0.0, "s", 2000, PREFIX, 4)]
    cold = simulate(tiny_config(mode), turn).records()[0]
    warm = simulate(tiny_config(mode), turn, warm_start=True).records()[0]
    assert cold.prefill_hit_tokens == 0 and cold.decode_hit_tokens == 0
    assert warm.prefill_hit_tokens == PREFIX
    assert warm.decode_hit_tokens == (PREFIX if decoder_reuses_its_cache else 0)
    if mode != "pd_cross_dc_naive":  # its first token also waits for the whole KV to cross the WAN
        assert warm.ttft_s == pytest.approx(prefill_s(2000 - PREFIX, PREFIX), rel=1e-12)
    assert warm.ttft_s < cold.ttft_s


def test_in_pdd_only_the_blocks_main_decode_lacks_cross_the_wan():
    turn = [Request(0.0, "s", 2000, PREFIX, 4)]
    cold = simulate(tiny_config("pdd"), turn).records()[0]
    warm = simulate(tiny_config("pdd"), turn, warm_start=True).records()[0]
    assert cold.wan_bytes == math.ceil(2000 / BLOCK) * BLOCK * KVB
    assert warm.wan_bytes == (math.ceil(2000 / BLOCK) - PREFIX // BLOCK) * BLOCK * KVB


def test_conversations_that_start_in_the_run_are_served_as_from_a_cold_start():
    new = [Request(0.5 * i, f"s{i}", 3000, 0, 20) for i in range(10)]
    followed = new + [Request(10 + 0.5 * i, f"s{i}", 3500, 3020, 20) for i in range(10)]
    cold = simulate(tiny_config("pdd", roles__prefill__replicas=2), followed).records()
    warm = simulate(tiny_config("pdd", roles__prefill__replicas=2), followed, warm_start=True).records()
    assert warm == cold


def test_warm_conversations_spread_over_the_replicas_and_keep_them():
    config = tiny_config("pdd", roles__prefill__replicas=3, roles__main_decode__replicas=3)
    under_way = [Request(0.01 * i, f"s{i}", 3300, 3200, 8) for i in range(30)]
    next_turns = [Request(30 + 0.01 * i, f"s{i}", 3600, 3308, 8) for i in range(30)]
    twin = Twin(config, warm_start=True)
    rows = twin.run(under_way + next_turns).arrays()
    first = rows["arrival"] < 30
    assert np.all(rows["p_hit"][first] == 3200) and np.all(rows["d_hit"][first] == 3200)
    # placed by the conductor's routing, which sends turns where their context is: on every
    # replica of both caching roles, none on the relay
    for inst in twin.P + twin.M:
        assert 5 <= len(inst.cache.entries) <= 15
    assert all(inst.cache.used == 0 for inst in twin.R)
    assert np.all(rows["p_hit"][~first] == 3308 // BLOCK * BLOCK)
    assert np.all(rows["d_hit"][~first] == 3308 // BLOCK * BLOCK)


def test_a_warm_start_fills_caches_no_further_than_they_hold():
    small = tiny_config("pdd", node_groups__a__spec__memory_gib=2.5, node_groups__b__spec__memory_gib=2.5)
    under_way = [Request(0.01 * i, f"s{i}", 13_000, 12_800, 4) for i in range(200)]
    twin = Twin(small, warm_start=True)
    rows = twin.run(under_way).arrays()
    assert len(rows["rid"]) == 200 and len(set(rows["rid"].tolist())) == 200
    for inst in twin.P + twin.M:
        assert 0 < inst.cache.used <= inst.cache.limit
    assert twin.P[0].cache.evicted_tokens > 0


def test_timed_traffic_starts_warm_unless_told_otherwise():
    config = tiny_config("pdd")
    warm = TimedTraffic(SMALL, warmup_s=0, window_s=60)
    cold = TimedTraffic(SMALL, warmup_s=0, window_s=60, warm_start=False)
    runs = [t.run(config, 2.0, seed=3) for t in (warm, cold)]
    assert runs[0].records() == simulate(config, warm.at(2.0, seed=3), seed=3, warm_start=True).records()
    assert runs[1].records() == simulate(config, cold.at(2.0, seed=3), seed=3).records()
    hits = [r.summary(0.0) for r in runs]
    assert hits[0].prefill_hit > hits[1].prefill_hit and hits[0].decode_hit > hits[1].decode_hit
