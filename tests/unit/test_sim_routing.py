"""The twin routes with the conductor's PrefixIndex: run-length storage equals ReplicaCache,
synthetic keys follow the trace's prefix semantics, and the twin's choices are
PrefixIndex.choose's on the same inputs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import app.sim.twin
from app.conductor.prefix_index import _LRU, PrefixIndex, ReplicaCache
from app.config import RoleName
from app.policy import Pipeline
from app.sim import Outage, simulate
from app.sim.routing import STRIDE, Conversation, KeyChain, KeyMaker, RunLRU, RunReplicaCache
from app.sim.workload import AgenticWorkload, Request
from tests.unit.test_sim_twin import tiny_args, tiny_config


def lru_order(cache: RunLRU) -> list[int]:
    return [g.line * STRIDE + i for g in cache.order.values() for a, b in g.pieces for i in range(a, b)]


# ---- keys -------------------------------------------------------------------------------


def test_a_turn_that_appends_keeps_every_key_and_extends_the_line():
    km, conv = KeyMaker(16), Conversation()
    first = km.turn(conv, 0, 100)  # 6 full blocks
    second = km.turn(conv, 100, 260)  # the whole stream repeats: 16 blocks, same line
    assert len(first) == 6 and len(second) == 16
    assert list(second)[:6] == list(first)
    assert len(second.segs) == 1


def test_a_rewritten_context_keeps_the_prefix_keys_and_gets_new_ones_after_it():
    km, conv = KeyMaker(16), Conversation()
    old = list(km.turn(conv, 0, 320))  # 20 blocks
    new = list(km.turn(conv, 70, 200))  # only 70 tokens repeat: 4 whole blocks
    assert new[:4] == old[:4]
    assert not set(new[4:]) & set(old)
    other = list(km.turn(Conversation(), 0, 320))
    assert not set(other) & set(old)  # conversations never share keys


def test_key_chain_reads_like_a_list():
    chain = KeyChain(((3, 0, 4), (7, 4, 6)), 6)
    as_list = [3 * STRIDE + i for i in range(4)] + [7 * STRIDE + 4, 7 * STRIDE + 5]
    assert list(chain) == as_list and len(chain) == 6
    assert [chain[i] for i in range(6)] == as_list and chain[-1] == as_list[-1]
    assert list(chain.head(5)) == as_list[:5] and chain.head(9) is chain
    with pytest.raises(IndexError):
        chain[6]


# ---- RunLRU == _LRU, RunReplicaCache == ReplicaCache ------------------------------------------

ops_st = st.lists(
    st.tuples(st.sampled_from(["turn", "add", "add", "discard", "discard_keys", "match"]), st.integers(0, 3), st.integers(0, 400), st.integers(0, 400)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, capacity=st.integers(1, 60))
def test_run_lru_behaves_as_the_index_lru_key_by_key(ops, capacity):
    km = KeyMaker(16)
    convs = [Conversation() for _ in range(4)]
    streams = [0] * 4
    chains = [km.turn(c, 0, 16) for c in convs]
    run, ref = RunLRU(capacity), _LRU(capacity)
    for op, c, x, y in ops:
        chain = chains[c]
        if op == "turn":  # keep x/400 of the stream, then grow by y tokens
            keep = streams[c] * x // 400
            streams[c] = keep + y
            chains[c] = chain = km.turn(convs[c], keep, streams[c])
        elif op == "add":
            part = chain.head(len(chain) * x // 400)
            run.add(part)
            ref.add(list(part))
        elif op == "discard":  # a suffix, as ReplicaCache.forget_from drops it
            part = chain[len(chain) * x // 400 :]
            run.discard(part)
            ref.discard(list(part))
        elif op == "discard_keys":  # any keys, as PrefixIndex.unroute passes them
            keys = [k for k in chain if k % 3 != y % 3]
            run.discard(keys)
            ref.discard(keys)
        assert run.matched(chain) == ref.matched(list(chain))
        assert len(run) == len(ref)
        assert lru_order(run) == list(ref._keys)
        assert all((k in run) == (k in ref) for k in chain)


@settings(max_examples=60, deadline=None)
@given(ops=ops_st, capacity=st.integers(1, 60))
def test_run_replica_cache_behaves_as_replica_cache(ops, capacity):
    km = KeyMaker(16)
    convs = [Conversation() for _ in range(4)]
    chains = [km.turn(c, 0, 16 * (1 + i)) for i, c in enumerate(convs)]
    run, ref = RunReplicaCache(capacity), ReplicaCache(capacity)
    for op, c, x, _ in ops:
        chain = chains[c]
        if op in ("add", "turn"):
            run.held.add(chain.head(len(chain) * x // 400))
            ref.held.add(list(chain.head(len(chain) * x // 400)))
            run.routed.add(chain)
            ref.routed.add(list(chain))
        elif op.startswith("discard"):
            first = len(chain) * x // 400
            run.forget_from(chain, first)
            ref.forget_from(list(chain), first)
        assert len(run) == len(ref)
        assert lru_order(run.held) == list(ref.held._keys) and lru_order(run.routed) == list(ref.routed._keys)


def test_run_lru_evicts_oldest_blocks_first_even_mid_chain():
    run, ref = RunLRU(5), _LRU(5)
    chain = KeyMaker(16).turn(Conversation(), 0, 16 * 8)
    run.add(chain)
    ref.add(list(chain))
    # the chain's first blocks went first: the index then matches nothing of it, as the real one
    assert run.matched(chain) == ref.matched(list(chain)) == 0
    assert lru_order(run) == list(ref._keys)


# ---- the twin's choices are PrefixIndex.choose's ------------------------------------------------

UPDATES = ("route", "unroute", "record", "observe")


def _logging(twin: app.sim.twin.Twin) -> list[tuple]:
    """Every index call the twin makes, with its keys as a list and, for choose, the loads it saw."""
    log: list[tuple] = []
    index = twin.index
    choose = index.choose

    def logged_choose(candidates, keys, load, room):
        choice = choose(candidates, keys, load, room)
        log.append(("choose", dict(candidates), list(keys), {rid: load(rid) for rid in candidates}, room, choice))
        return choice

    def logging(name):
        real = getattr(index, name)

        def call(*args):
            log.append((name, args[0], list(args[1]), *args[2:]))
            real(*args)

        return call

    index.choose = logged_choose
    for name in UPDATES:
        setattr(index, name, logging(name))
    return log


@pytest.mark.parametrize("mode", ["pdd", "pd_intra_dc", "colocated", "pd_cross_dc_naive"])
def test_replica_choices_equal_prefix_index_choose_on_the_same_inputs(mode):
    # three replicas per role, and KV room for only a few conversations: affinity, load
    # balancing, ties and evictions (observe corrections) all happen
    args = tiny_args(mode)
    for group in args["node_groups"].values():
        group["spec"]["memory_gib"] = 2.2
    for role in args["roles"].values():
        role["replicas"] = 3
    config = app.sim.twin.PDDConfig.model_validate(args)
    workload = AgenticWorkload(
        requests=400,
        rps=4.0,
        seed=5,
        first_prompt_median=3000,
        max_context_tokens=16000,
        output_median=60,
        think_time_min_s=1,
        think_time_mean_s=2,
        turns_min=3,
        turns_max=8,
    )
    twin = app.sim.twin.Twin(config)
    log = _logging(twin)
    twin.run(workload.generate())
    chooses = [e for e in log if e[0] == "choose"]
    assert len({e[5].replica_id for e in chooses}) >= 3  # every replica of a role was chosen
    assert any(e[0] == "observe" for e in log)
    # replay into the real index, with the real per-replica store
    real = PrefixIndex(config.model.block_size)
    for entry in log:
        if entry[0] == "choose":
            _, candidates, keys, loads, room, made = entry
            assert real.choose(candidates, keys, loads.__getitem__, room) == made
        else:
            getattr(real, entry[0])(*entry[1:])
    if mode == "pd_cross_dc_naive":
        assert any(e[0] == "unroute" for e in log)


@pytest.mark.parametrize("mode", ["pdd", "pd_intra_dc", "colocated", "pd_cross_dc_naive"])
def test_every_replica_keeps_its_conversations_until_its_batch_is_full(mode):
    """policy.affinity_room at each of the twin's routing calls, as at the conductor's: the role's max_num_seqs."""
    config = tiny_config(mode)
    twin = app.sim.twin.Twin(config)
    log = _logging(twin)
    twin.run(AgenticWorkload(requests=40, rps=4.0, seed=1, first_prompt_median=2000, output_median=20).generate())
    rooms = {}
    for e in log:
        if e[0] == "choose":
            rooms.setdefault(e[5].replica_id.rsplit("-", 1)[0], set()).add(e[4])
    batches = {role: {config.roles.get(RoleName(role)).engine.max_num_seqs} for role in rooms}
    assert rooms == batches and (mode == "colocated" or "prefill" in rooms)


def test_twin_uses_prefix_index_itself():
    twin = app.sim.twin.Twin(tiny_config("pdd"))
    assert type(twin.index) is PrefixIndex
    assert twin.index.imbalance_limit == PrefixIndex(16).imbalance_limit


def test_a_conversation_stays_on_its_replicas_turn_after_turn():
    args = tiny_args("pdd")
    for role in args["roles"].values():
        role["replicas"] = 4
    config = app.sim.twin.PDDConfig.model_validate(args)
    twin = app.sim.twin.Twin(config)
    log = _logging(twin)
    turns = [Request(10.0 * k, "s", 3000 + 400 * k, 3000 + 400 * k - 300 if k else 0, 50) for k in range(5)]
    twin.run(turns)
    picks = {}
    for e in log:
        if e[0] == "choose":
            role = e[5].replica_id.rsplit("-", 1)[0]
            picks.setdefault(role, set()).add(e[5].replica_id)
    assert all(len(v) == 1 for v in picks.values())
    # and from the second turn on the index expected the previous turn's prefix there
    md_estimates = [e[5].cached_tokens for e in log if e[0] == "choose" and e[5].replica_id.startswith("main")]
    assert md_estimates[0] == 0 and all(est > 0 for est in md_estimates[1:])


# ---- outages: P-RLD while the WAN is cut or no main decoder is alive, P-P-MD while no relay decoder is --


@pytest.mark.parametrize("what", ["wan", "main_decode"])
def test_outage_sends_requests_to_the_relay_and_back_after(what):
    reqs = [Request(float(t), f"s{t}", 2000, 0, 20) for t in range(0, 30, 3)]
    run = simulate(tiny_config("pdd"), reqs, outages=[Outage(10.0, 20.0, what)])
    pipes = [(r.arrival_s, r.pipeline) for r in run.records()]
    assert all((p is Pipeline.p_rld) == (10 <= t < 20) for t, p in pipes)
    assert all(r.wan_bytes == 0 for r in run.records() if r.pipeline is Pipeline.p_rld)


def test_prefill_relays_while_no_relay_decoder_is_alive():
    reqs = [Request(float(t), f"s{t}", 20_000, 0, 100) for t in range(0, 30, 3)]
    outage = [Outage(10.0, 20.0, "relay_decode")]
    run = simulate(tiny_config("pdd", routing={"max_wan_transfer_ms": 0}), reqs, outages=outage)
    pipes = [(r.arrival_s, r.pipeline) for r in run.records()]
    assert all((p is Pipeline.p_p_md) == (10 <= t < 20) for t, p in pipes)
    relayed = [r for r in run.records() if r.pipeline is Pipeline.p_p_md]
    assert all(r.relay_tokens > 0 and r.wan_bytes > 0 for r in relayed)
    # without P's relay those requests show MD's WAN pull as a gap
    without = tiny_config("pdd", routing={"max_wan_transfer_ms": 0, "prefill_relays": False})
    pulled = [r for r in simulate(without, reqs, outages=outage).records() if 10 <= r.arrival_s < 20]
    assert all(r.pipeline is Pipeline.p_md for r in pulled)
    assert max(r.max_gap_s for r in relayed) < min(r.max_gap_s for r in pulled) / 2


def test_unknown_outage_kind_is_refused():
    with pytest.raises(ValueError, match="outage"):
        simulate(tiny_config("pdd"), [Request(0.0, "s", 100, 0, 2)], outages=[Outage(0, 1, "prefill")])


def test_no_decoder_alive_at_all_is_refused():
    with pytest.raises(ValueError, match="neither decoder alive"):
        simulate(tiny_config("pdd"), [Request(0.0, "s", 100, 0, 2)], outages=[Outage(0, 2, "main_decode"), Outage(1, 3, "relay_decode")])


def test_a_transfer_waits_for_the_cut_link():
    # routed P-MD before the cut; the prefill ends during it, so MD's pull starts when the link is back
    r = simulate(tiny_config("pdd"), [Request(0.0, "s", 2000, 0, 3)], outages=[Outage(0.01, 5.0, "wan")]).records()[0]
    assert r.pipeline is Pipeline.p_md
    assert r.ttft_s < 0.5 and r.max_gap_s > 4.9


def test_random_outages_keep_conservation():
    rng = random.Random(3)
    reqs = sorted(
        (Request(rng.uniform(0, 30), rng.randrange(8), rng.randrange(100, 6000), 0, rng.randrange(1, 300)) for _ in range(80)), key=lambda r: r.arrival_s
    )
    outages = [Outage(5, 9, "wan"), Outage(8, 15, "main_decode"), Outage(20, 21, "wan"), Outage(15, 24, "relay_decode")]
    run = simulate(tiny_config("pdd", handoff={"mode": "catch_up", "catch_up_threshold_tokens": 4, "relay_cap_tokens": 64}), reqs, outages=outages)
    assert sorted(r.rid for r in run.records()) == list(range(len(reqs)))
