"""Replicas on one Host slow each other down (app/sim/engine.py), by hand."""

from __future__ import annotations

import pytest

from app.config import Mode, RoleName
from app.sim.cluster import build_cluster
from app.sim.engine import Instance
from app.sim.events import Loop
from app.sim.jobs import Gaps
from app.sim.perf import FittedPerf
from app.sim.work import Host, PrefillJob, Seq
from tests.unit.test_sim_twin import tiny_config

STEP = FittedPerf(a_ms=100.0, b_ms_per_prefill_token=0.0, c_ms_per_decode_seq=0.0, d_ms_per_kv_token=0.0, neighbor_slowdown=0.5)
"""Every step 100 ms alone; each busy neighbor adds half."""


def _hosted(loop: Loop, *perfs: FittedPerf) -> list[Instance]:
    host = Host()
    out = []
    for i, perf in enumerate(perfs):
        inst = Instance(loop, f"i{i}", perf, max_seqs=8, max_batched=512, capacity=100_000, block_size=16)
        host.join(inst)
        out.append(inst)
    return out


def _prefill(loop: Loop, inst: Instance, at: float, done: dict) -> None:
    def submit(_):
        lease = inst.open(("conv", inst.name), 0, (), 0)
        inst.submit_prefill(PrefillJob(inst.name, 64, 0, 64, lease, lambda job: done.setdefault(inst.name, loop.now)))

    loop.at(at, submit)


def test_a_step_in_flight_finishes_its_remaining_share_at_the_new_rate():
    loop = Loop()
    a, b = _hosted(loop, STEP, STEP)
    done: dict[str, float] = {}
    _prefill(loop, a, 0.0, done)
    _prefill(loop, b, 0.05, done)
    loop.run()
    # a: 50 ms alone, then its last 50 ms at 1.5x (b busy) -> 125 ms; b: 1.5x from 50 ms until a ends
    # (75 ms of its 150), then its last 75 ms of slowed time at 1x -> 50 ms more
    assert done == {"i0": pytest.approx(0.125), "i1": pytest.approx(0.175)}
    assert (a.busy_s, b.busy_s) == (pytest.approx(0.125), pytest.approx(0.125))
    assert a.host.busy == 0


def test_a_decode_epoch_is_planned_again_at_its_next_step_boundary():
    loop = Loop()
    decode = FittedPerf(a_ms=10.0, b_ms_per_prefill_token=0.0, c_ms_per_decode_seq=0.0, d_ms_per_kv_token=0.0, neighbor_slowdown=0.5)
    a, b = _hosted(loop, decode, STEP)
    finished: dict[str, tuple[float, float]] = {}
    lease = a.open("seq", 0, (), 0)
    a.submit_decode(Seq("seq", 100, 10, 110, lease, lambda seq, worst: finished.setdefault("seq", (loop.now, worst))))
    done: dict[str, float] = {}
    _prefill(loop, b, 0.025, done)
    loop.run()
    # 3 tokens at 10 ms (b starts mid-step 3), 7 at 15 ms -> 135 ms; b runs at 1.5x until then
    # (110 ms of slowed time = 73.3 ms alone), its last 26.7 ms alone at 1x
    assert finished["seq"] == (pytest.approx(0.135), pytest.approx(0.015))
    assert done["i1"] == pytest.approx(0.135 + (0.1 - 0.11 / 1.5))


def test_mds_wait_is_slowed_by_its_busy_neighbors():
    loop = Loop()
    decode = FittedPerf(a_ms=10.0, b_ms_per_prefill_token=0.0, c_ms_per_decode_seq=0.0, d_ms_per_kv_token=0.0, neighbor_slowdown=0.5)
    a, b = _hosted(loop, decode, STEP)
    gaps = Gaps("x->y", [a.name], 0.0)
    seen: list[float] = []
    _prefill(loop, b, 0.0, {})
    loop.at(0.05, lambda _: seen.append(gaps.md_wait_ms(a)))  # b's prefill in flight
    loop.at(0.5, lambda _: seen.append(gaps.md_wait_ms(a)))  # b done
    loop.run()
    assert seen == [pytest.approx(2 * 15.0), pytest.approx(2 * 10.0)]


def test_replicas_share_a_host_only_when_a_model_was_fitted_on_one():
    config = tiny_config("pdd")
    plain = FittedPerf(a_ms=5.0, b_ms_per_prefill_token=0.01, c_ms_per_decode_seq=0.0, d_ms_per_kv_token=0.0)
    separate = build_cluster(config, Loop(), Mode.pdd, plain)
    assert all(inst.host is None for pool in separate.pools.values() for inst in pool)
    models = {"prefill": plain, "relay_decode": plain, "main_decode": FittedPerf(5.0, 0.01, 0.0, 0.0, neighbor_slowdown=0.3)}
    shared = build_cluster(config, Loop(), Mode.pdd, models)
    hosts = {id(inst.host) for pool in shared.pools.values() for inst in pool}
    assert len(hosts) == 1 and None not in {inst.host for inst in shared.pools[RoleName.prefill]}
    assert len(shared.pools[RoleName.prefill][0].host.members) == sum(len(pool) for pool in shared.pools.values())
