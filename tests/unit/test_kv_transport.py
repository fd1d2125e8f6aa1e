"""Block server, pulls, leases and the link relay over real loopback sockets,
with real torch tensors standing in for two engines' paged KV caches."""

import asyncio
import socket
import threading
import time
from collections import defaultdict

import pytest
import torch

from app.config import LinkConfig, PullOrder
from app.engine.cluster_tls import ClusterTLS, Credentials
from app.engine.kv.leases import LeaseIds, LeaseTable
from app.engine.kv.limits import ConnectionLimits
from app.engine.kv.link import LinkModel, LinkRelay
from app.engine.kv.pull_threads import PullThreads
from app.engine.kv.transport import BlockServer, KVLayout, PullRequest, PullSpec, _send_msg, pull_blocks, release_lease
from app.telemetry import metrics

CREDENTIALS = Credentials.generate()
TLS = ClusterTLS(CREDENTIALS)
IDS = LeaseIds.for_block_server(CREDENTIALS.key, ("127.0.0.1", 0))
L: defaultdict[str, str] = defaultdict(IDS.issue)
"""Genuine lease ids by test name, issued on first use."""

NUM_BLOCKS = 16
LAYERS = 2


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    # CPU attention layout: [num_blocks, kv_heads, block_size, 2 * head_dim]
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, 4, 32, 128, generator=g) for i in range(LAYERS)}


@pytest.fixture(autouse=True)
def _fresh_lease_ids():
    L.clear()


def block_server(layout, leases, allow_plaintext=False, per_peer=64):
    return BlockServer(
        lambda: layout, leases, IDS, ("127.0.0.1", 0), TLS.server, ConnectionLimits("KV block server", per_peer, 256), allow_plaintext, lease_wait_s=0.5
    )


@pytest.fixture
def source():
    kv = caches(1)
    layout = KVLayout.from_caches(kv, NUM_BLOCKS)
    leases = LeaseTable()
    server = block_server(layout, leases)
    yield kv, layout, leases, server
    server.close()


def spec(server, lease, remote, local, relay=None):
    return PullSpec("req-1", lease, ("127.0.0.1", server.port), relay, "a->b", remote, local)


@pytest.mark.parametrize("order", list(PullOrder))
def test_a_small_pull_overtakes_a_large_waiting_one_only_under_smallest_first(source, order):
    kv, layout, leases, server = source
    leases.add(L["large"], block_ids=[1, 2, 3, 4, 5, 6], consumers=1, ttl_s=30)
    leases.add(L["small"], block_ids=[8], consumers=1, ttl_s=30)
    threading.Timer(0.3, leases.add, args=(L["late"],), kwargs={"block_ids": [9], "consumers": 1, "ttl_s": 30}).start()
    dst = caches(4)
    dst_layout = KVLayout.from_caches(dst, NUM_BLOCKS)
    pull_threads = PullThreads(1, order)
    try:
        holder = pull_threads.submit(1, pull_blocks, spec(server, L["late"], [0], [0]), dst_layout, TLS.client, 2, 10, time.monotonic())
        time.sleep(0.05)  # the holder has the only thread
        submitted = {"large": time.monotonic()}
        large = pull_threads.submit(
            6, pull_blocks, spec(server, L["large"], list(range(6)), [1, 2, 3, 4, 5, 6]), dst_layout, TLS.client, 2, 10, submitted["large"]
        )
        submitted["small"] = time.monotonic()
        small = pull_threads.submit(1, pull_blocks, spec(server, L["small"], [0], [8]), dst_layout, TLS.client, 2, 10, submitted["small"])
        results = {"holder": holder.result(5), "large": large.result(5), "small": small.result(5)}
    finally:
        pull_threads.shutdown()
    assert all(r.ok for r in results.values())
    started = {name: submitted[name] + results[name].queued_seconds for name in submitted}
    first, then = ("small", "large") if order is PullOrder.smallest_first else ("large", "small")
    assert started[then] >= started[first] + results[first].seconds  # one thread: the second starts once the first ended
    for name in kv:
        assert torch.equal(dst[name][8], kv[name][8]) and torch.equal(dst[name][6], kv[name][6])


def test_pull_copies_exactly_the_requested_blocks(source):
    kv, layout, leases, server = source
    leases.add(L["lease-1"], block_ids=[3, 7, 9, 11], consumers=1, ttl_s=30)
    dst = caches(2)
    dst_layout = KVLayout.from_caches(dst, NUM_BLOCKS)
    before = {n: t.clone() for n, t in dst.items()}
    result = pull_blocks(spec(server, L["lease-1"], [1, 2], [5, 6]), dst_layout, TLS.client, 2, 10)
    assert result.ok and result.blocks == 2 and result.bytes == 2 * layout.block_nbytes
    assert result.queued_seconds == 0.0  # not submitted through pull threads
    for name in kv:
        assert torch.equal(dst[name][5], kv[name][7]) and torch.equal(dst[name][6], kv[name][9])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6)]
        assert torch.equal(dst[name][untouched], before[name][untouched])
    assert _done_soon(leases) == {L["lease-1"]} and len(leases) == 0


def test_a_pull_waiting_for_a_pull_thread_reports_its_wait_apart_from_its_transfer(source):
    kv, layout, leases, server = source
    leases.add(L["ready"], block_ids=[1], consumers=1, ttl_s=30)
    # the first pull holds the only thread until its lease appears, 0.3 s on
    threading.Timer(0.3, leases.add, args=(L["late"],), kwargs={"block_ids": [2], "consumers": 1, "ttl_s": 30}).start()
    dst = caches(3)
    dst_layout = KVLayout.from_caches(dst, NUM_BLOCKS)
    pull_threads = PullThreads(1, PullOrder.smallest_first)  # as the connector submits them
    try:
        first = pull_threads.submit(1, pull_blocks, spec(server, L["late"], [0], [4]), dst_layout, TLS.client, 2, 10, time.monotonic())
        second = pull_threads.submit(1, pull_blocks, spec(server, L["ready"], [0], [5]), dst_layout, TLS.client, 2, 10, time.monotonic())
        first, second = first.result(5), second.result(5)
    finally:
        pull_threads.shutdown()
    assert first.ok and second.ok
    assert first.seconds >= 0.25 and first.queued_seconds < 0.25 <= second.queued_seconds
    for name in kv:
        assert torch.equal(dst[name][4], kv[name][2]) and torch.equal(dst[name][5], kv[name][1])


def test_block_bytes_are_all_layers_of_one_block(source):
    kv, layout, *_ = source
    assert layout.block_nbytes == LAYERS * 4 * 32 * 128 * 4


def _done_soon(leases, timeout_s=5.0):
    """The server counts a pull once it has sent everything, just after the client read it."""
    deadline = time.monotonic() + timeout_s
    done = set()
    while not done and time.monotonic() < deadline:
        done = leases.take_done()
        time.sleep(0.01)
    return done


def test_lease_waits_for_all_consumers_then_frees(source):
    _, _, leases, server = source
    leases.add(L["l"], [0], consumers=2, ttl_s=30)
    assert release_lease(("127.0.0.1", server.port), L["l"], TLS.client)
    assert _done_soon(leases, timeout_s=0.5) == set() and len(leases) == 1
    assert release_lease(("127.0.0.1", server.port), L["l"], TLS.client)
    assert _done_soon(leases) == {L["l"]}


def test_lease_expires():
    leases = LeaseTable()
    leases.add("l", [0], consumers=1, ttl_s=5)
    assert leases.expire(now=time.monotonic() + 1) == []
    assert leases.expire(now=time.monotonic() + 10) == ["l"]
    assert leases.take_done() == {"l"} and len(leases) == 0


def test_pull_of_unknown_lease_fails_cleanly_and_reports_blocks(source):
    _, _, _, server = source
    dst = caches(4)
    result = pull_blocks(spec(server, "nope", [0, 1], [2, 3]), KVLayout.from_caches(dst, NUM_BLOCKS), TLS.client, 2, 10)
    # named apart from link failures: a lease that expired while its pull queued is not a broken link
    assert not result.ok and result.error.startswith(f"{metrics.KV_LEASE_GONE}: no such lease")
    assert "nope" not in result.error  # a lease id is a capability: never echoed into logs
    assert result.failed_block_ids == [2, 3]


def test_lease_ids_are_told_genuine_fresh_or_forged_at_once(source):
    """Forged, tampered, another server's, an ended one replayed, or one too old to be live:
    each is refused without waiting (the server's lease wait is 0.5 s here). Only a genuine
    fresh id the table does not hold yet is waited for."""
    _, _, leases, server = source
    leases.add(L["done"], [0], consumers=1, ttl_s=30)
    assert release_lease(("127.0.0.1", server.port), L["done"], TLS.client)
    genuine = IDS.issue()
    tampered = genuine[:-2] + ("A" if genuine[-2] != "A" else "B") + genuine[-1]
    elsewhere = LeaseIds.for_block_server(CREDENTIALS.key, ("127.0.0.1", 1)).issue()
    old = IDS.issue(now=time.monotonic() - 60)
    for lease_id in ("nope", tampered, elsewhere, L["done"], old):
        t0 = time.monotonic()
        result = pull_blocks(spec(server, lease_id, [0], [1]), KVLayout.from_caches(caches(5), NUM_BLOCKS), TLS.client, 2, 10)
        assert not result.ok and "no such lease" in result.error
        assert time.monotonic() - t0 < 0.4, lease_id
    t0 = time.monotonic()
    assert not pull_blocks(spec(server, genuine, [0], [1]), KVLayout.from_caches(caches(5), NUM_BLOCKS), TLS.client, 2, 10).ok
    assert time.monotonic() - t0 >= 0.5


def test_a_lease_registered_just_after_the_pull_arrives_is_served(source):
    _, _, leases, server = source
    threading.Timer(0.1, leases.add, args=(L["late"], [0], 1, 30)).start()
    result = pull_blocks(spec(server, L["late"], [0], [1]), KVLayout.from_caches(caches(5), NUM_BLOCKS), TLS.client, 2, 10)
    assert result.ok


def test_layout_mismatch_is_refused(source):
    _, _, leases, server = source
    leases.add(L["l"], [0], consumers=1, ttl_s=30)
    other = {f"layer.{i}": torch.zeros(NUM_BLOCKS, 4, 32, 64) for i in range(LAYERS)}
    result = pull_blocks(spec(server, L["l"], [0], [1]), KVLayout.from_caches(other, NUM_BLOCKS), TLS.client, 2, 10)
    assert not result.ok and "layout differs" in result.error


def test_block_index_outside_lease_is_refused(source):
    _, _, leases, server = source
    leases.add(L["l"], [0], consumers=1, ttl_s=30)
    result = pull_blocks(spec(server, L["l"], [5], [1]), KVLayout.from_caches(caches(6), NUM_BLOCKS), TLS.client, 2, 10)
    assert not result.ok and "outside" in result.error


def test_unreachable_source_fails_without_raising():
    result = pull_blocks(PullSpec("r", "l", ("127.0.0.1", 1), None, "x", [0], [0]), KVLayout.from_caches(caches(7), NUM_BLOCKS), TLS.client, 1, 2)
    assert not result.ok and result.failed_block_ids == [0]


# ---- through the link relay -------------------------------------------------------


class RelayThread:
    """A LinkRelay on its own event loop thread (the pull side is blocking code)."""

    def __init__(self, config: LinkConfig, server: BlockServer):
        self.loop = asyncio.new_event_loop()
        self.relay = LinkRelay("a->b", LinkModel(config), "127.0.0.1", self._only(("127.0.0.1", server.port)))
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = self.call(self.relay.start())

    @staticmethod
    def _only(block_server):
        async def allowed(address):
            return address == block_server

        return allowed

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def cut(self, seconds):
        self.loop.call_soon_threadsafe(self.relay.cut, seconds)

    def close(self):
        self.call(self.relay.close())
        self.call(self._cancel_connections())  # as asyncio.run ends: no task left pending on a dead loop
        self.loop.call_soon_threadsafe(self.loop.stop)

    @staticmethod
    async def _cancel_connections():
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_relay_paces_to_the_link_bandwidth(source):
    _, layout, leases, server = source
    leases.add(L["l"], list(range(8)), consumers=1, ttl_s=30)
    mbps, rtt_ms = 40.0, 50.0
    relay = RelayThread(LinkConfig(between=("a", "b"), bandwidth_mbps=mbps, rtt_ms=rtt_ms), server)
    try:
        t0 = time.monotonic()
        result = pull_blocks(
            spec(server, L["l"], list(range(8)), list(range(8)), relay=("127.0.0.1", relay.port)),
            KVLayout.from_caches(caches(8), NUM_BLOCKS),
            TLS.client,
            2,
            30,
        )
        elapsed = time.monotonic() - t0
        assert result.ok
        floor = rtt_ms / 1000 + 8 * layout.block_nbytes / (mbps * 1e6 / 8)
        assert elapsed >= floor * 0.97, (elapsed, floor)  # never faster than the link
        header_bound = 4096
        assert result.bytes <= relay.relay.counters.bytes_down <= result.bytes + header_bound
    finally:
        relay.close()


def test_pulls_sharing_a_healthy_link_take_what_its_shared_model_says(source):
    """Four pulls started together through the emulator: each takes about four times an idle
    link's time, and what LinkShare (the conductor's yardstick for the agents) says."""
    from concurrent.futures import ThreadPoolExecutor

    from app.engine.kv.link import LinkShare

    _, layout, leases, server = source
    config = LinkConfig(between=("a", "b"), bandwidth_mbps=40, rtt_ms=20)
    relay = RelayThread(config, server)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    share = LinkShare(config.bandwidth_mbps * 1e6 / 8)
    try:
        for i, ids in enumerate(blocks):
            leases.add(L[f"l{i}"], ids, consumers=1, ttl_s=30)
            share.start(f"p{i}", len(ids) * layout.block_nbytes, now=0.0)
        dst = KVLayout.from_caches(caches(9), NUM_BLOCKS)
        with ThreadPoolExecutor(len(blocks)) as pool:
            results = list(
                pool.map(
                    lambda i: pull_blocks(spec(server, L[f"l{i}"], [0, 1, 2], blocks[i], relay=("127.0.0.1", relay.port)), dst, TLS.client, 2, 30),
                    range(len(blocks)),
                )
            )
    finally:
        relay.close()
    assert all(r.ok for r in results)
    idle = config.mean_latency_s + 3 * layout.block_nbytes / (40e6 / 8)
    shared = [config.mean_latency_s + share.finish(f"p{i}", now=60.0) for i in range(len(blocks))]
    slowdowns = [r.seconds / s for r, s in zip(results, shared, strict=True)]
    assert sum(r.seconds for r in results) / len(results) >= 2.5 * idle  # against an idle link: "2.5x slower", though healthy
    assert 0.75 <= sum(slowdowns) / len(slowdowns) < 2.0, slowdowns  # under the agents' WAN_SLOWDOWN entry


def test_a_degraded_link_paces_to_its_new_figures_until_restored(source):
    _, layout, leases, server = source
    leases.add(L["l"], list(range(8)), consumers=2, ttl_s=30)
    configured = LinkConfig(between=("a", "b"), bandwidth_mbps=4000, rtt_ms=1)
    relay = RelayThread(configured, server)
    try:
        relay.relay.degrade(bandwidth_mbps=40, rtt_ms=50)
        t0 = time.monotonic()
        result = pull_blocks(
            spec(server, L["l"], list(range(8)), list(range(8)), relay=("127.0.0.1", relay.port)),
            KVLayout.from_caches(caches(8), NUM_BLOCKS),
            TLS.client,
            2,
            30,
        )
        assert result.ok
        assert time.monotonic() - t0 >= (0.05 + 8 * layout.block_nbytes / (40e6 / 8)) * 0.97
        relay.relay.restore()
        assert relay.relay.model.config == configured
        relay.relay.degrade(bandwidth_mbps=40)
        relay.relay.update(LinkModel(configured))  # a reconfigure ends the degradation too
        assert relay.relay.model.config.bandwidth_mbps == 4000
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            relay.relay.degrade(bandwidth_mbps=0)
    finally:
        relay.close()


def test_restoring_a_stalled_link_releases_the_transfers_it_held(source):
    """`pdd fault restore` ends a stall for the pulls already waiting on it, not only for new ones."""
    _, layout, leases, server = source
    leases.add(L["l"], list(range(4)), consumers=1, ttl_s=60)
    relay = RelayThread(LinkConfig(between=("a", "b"), bandwidth_mbps=4000, rtt_ms=1), server)
    try:
        relay.loop.call_soon_threadsafe(relay.relay.stall, 60)
        threading.Timer(0.5, relay.loop.call_soon_threadsafe, args=(relay.relay.restore,)).start()
        t0 = time.monotonic()
        result = pull_blocks(
            spec(server, L["l"], list(range(4)), list(range(4)), relay=("127.0.0.1", relay.port)),
            KVLayout.from_caches(caches(4), NUM_BLOCKS),
            TLS.client,
            2,
            90,
        )
        assert result.ok
        assert 0.5 <= time.monotonic() - t0 < 30  # held until the restore, not for the stall's 60 s
    finally:
        relay.close()


def test_cutting_the_link_mid_transfer_reports_unwritten_blocks(source):
    _, layout, leases, server = source
    leases.add(L["l"], list(range(12)), consumers=1, ttl_s=30)
    relay = RelayThread(LinkConfig(between=("a", "b"), bandwidth_mbps=8), server)  # ~1 s per MB
    try:
        threading.Timer(0.3, relay.cut, args=(5,)).start()
        result = pull_blocks(
            spec(server, L["l"], list(range(12)), list(range(12)), relay=("127.0.0.1", relay.port)),
            KVLayout.from_caches(caches(9), NUM_BLOCKS),
            TLS.client,
            2,
            30,
        )
        assert not result.ok
        assert 0 < len(result.failed_block_ids) <= 12
        assert result.failed_block_ids == list(range(12 - len(result.failed_block_ids), 12))  # the tail
        assert relay.relay.counters.cut_connections >= 1
        # while cut, new pulls are refused at once
        again = pull_blocks(spec(server, L["l"], [0], [0], relay=("127.0.0.1", relay.port)), KVLayout.from_caches(caches(9), NUM_BLOCKS), TLS.client, 2, 30)
        assert not again.ok
    finally:
        relay.close()


def test_jitter_draws_are_seeded_and_bounded():
    cfg = LinkConfig(between=("a", "b"), bandwidth_mbps=10, rtt_ms=20, jitter={"distribution": "pareto", "mean_ms": 50, "max_ms": 400}, seed=3)
    a = [LinkModel(cfg).first_byte_delay_s() for _ in range(1)] + [LinkModel(cfg).jitter_s() for _ in range(3)]
    b = [LinkModel(cfg).first_byte_delay_s() for _ in range(1)] + [LinkModel(cfg).jitter_s() for _ in range(3)]
    assert a == b
    model = LinkModel(cfg)
    draws = [model.jitter_s() for _ in range(2000)]
    assert all(0 <= d <= 0.4 for d in draws)
    assert 0.02 < sum(draws) / len(draws) < 0.08


def test_a_pull_without_the_clusters_certificate_gets_no_blocks(source):
    """A plaintext client naming a live lease, and TLS clients of another cluster: dropped in
    the handshake; the lease is neither served nor used up, and a member's pull still works."""
    _, _, leases, server = source
    leases.add(L["l"], [0, 1], consumers=1, ttl_s=30)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        _send_msg(sock, PullRequest(L["l"], [0, 1], "plaintext"))
        try:
            answer = sock.recv(1024)
        except ConnectionResetError:  # closed with our request unread
            answer = b""
        assert answer == b""
    other = Credentials.generate()
    for stranger in (ClusterTLS(other), ClusterTLS(Credentials(ca=CREDENTIALS.ca, cert=other.cert, key=other.key))):
        result = pull_blocks(spec(server, L["l"], [0, 1], [2, 3]), KVLayout.from_caches(caches(10), NUM_BLOCKS), stranger.client, 2, 10)
        assert not result.ok and result.blocks == 0
    assert len(leases) == 1 and leases.leases[L["l"]].pulls == 0
    assert pull_blocks(spec(server, L["l"], [0, 1], [2, 3]), KVLayout.from_caches(caches(10), NUM_BLOCKS), TLS.client, 2, 10).ok


def test_the_relay_forwards_only_to_registered_block_servers(source):
    """Not an open proxy: a preamble naming any other address is refused at once."""
    _, _, leases, server = source
    leases.add(L["l"], [0], consumers=1, ttl_s=30)
    relay = RelayThread(LinkConfig(between=("a", "b"), bandwidth_mbps=4000, rtt_ms=1), server)
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
            sock.sendall(b"127.0.0.1:22\n")
            try:
                answer = sock.recv(1024)
            except ConnectionResetError:
                answer = b""
        assert answer == b"" and relay.relay.counters.refused == 1
        assert pull_blocks(spec(server, L["l"], [0], [1], relay=("127.0.0.1", relay.port)), KVLayout.from_caches(caches(11), NUM_BLOCKS), TLS.client, 2, 10).ok
        assert relay.relay.counters.refused == 1
    finally:
        relay.close()


@pytest.mark.parametrize("allowed", [True, False])
def test_a_plaintext_pull_authenticates_then_moves_blocks_outside_tls_only_where_allowed(allowed):
    """`security.intra_dc_encryption` off: the request still goes over mutual TLS, the blocks
    follow in plaintext and land intact. A server that encrypts every pull refuses, keeping the lease."""
    kv = caches(12)
    leases = LeaseTable()
    server = block_server(KVLayout.from_caches(kv, NUM_BLOCKS), leases, allow_plaintext=allowed)
    try:
        leases.add(L["l"], [2, 5], consumers=1, ttl_s=30)
        dst = caches(13)
        pull = PullSpec("req-1", L["l"], ("127.0.0.1", server.port), None, "dc-a->dc-a", [0, 1], [7, 8], plaintext=True)
        result = pull_blocks(pull, KVLayout.from_caches(dst, NUM_BLOCKS), TLS.client, 2, 10)
        if allowed:
            assert result.ok and result.blocks == 2
            assert all(torch.equal(dst[n][7], kv[n][2]) and torch.equal(dst[n][8], kv[n][5]) for n in kv)
        else:
            assert not result.ok and "encrypts every pull" in result.error and len(leases) == 1
    finally:
        server.close()


def test_connections_beyond_a_peers_bound_are_closed_at_once_and_counted():
    leases = LeaseTable()
    server = block_server(KVLayout.from_caches(caches(14), NUM_BLOCKS), leases, per_peer=2)
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.limits.open < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as over:
            try:
                assert over.recv(1) == b""  # closed before any handshake
            except ConnectionResetError:
                pass
        assert server.limits.refused == 1 and server.limits.open == 2
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10  # each held connection ends at the handshake timeout or its close
    while server.limits.open and time.monotonic() < deadline:
        time.sleep(0.05)
    leases.add(L["l"], [0], consumers=1, ttl_s=30)
    assert server.limits.open == 0
    assert pull_blocks(spec(server, L["l"], [0], [1]), KVLayout.from_caches(caches(15), NUM_BLOCKS), TLS.client, 2, 10).ok
    server.close()
