"""The data plane against a hostile client, on the real running app (real engines, sockets, TLS).

Its own app, for two reasons: it runs with `security.intra_dc_encryption` off (pulls inside
dc-a authenticate, then move in plaintext; the WAN stays encrypted) and a small per-peer
connection bound, so a flood can be shown refused without touching legitimate traffic.

The hostile client is of two kinds: a stranger (no certificate, or another cluster's), and a
member gone rogue (the cluster's certificate, from the GCS as every replica gets it), who can
still not guess or replay a lease, send an oversized frame, use a relay as a proxy, or hold
more connections than its bound.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import socket
import ssl
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from app.engine.cluster_tls import PEER_NAME, ClusterTLS, Credentials, cluster_credentials, cluster_tls
from app.engine.kv import block_servers
from app.engine.kv.params import LEASE, PRODUCE
from app.engine.kv.transport import PullHeader, PullRequest, _recv_msg, _send_msg, release_lease
from app.engine.link_emulators import deployment_name as links_deployment
from app.engine.token_channel import _LEN, MAX_REQUEST_FRAME_BYTES, EngineRequest, SamplingOptions, TokenStreamClient
from app.ops.faults import Faults
from tests.conftest import local_args, set_wan
from tests.integration.conftest import completion, deploy_app
from tests.integration.relaying import fresh

PER_PEER = 8
WAN, INTRA = "dc-a->dc-b", "dc-a->dc-a"
HOSTILE_SOURCE = "127.0.0.9"
"""The rogue client's own address: on one host every replica's connections come from 127.0.0.1."""


@pytest.fixture(scope="module")
def app(serve_instance):
    args = local_args()
    args["security"] = {"intra_dc_encryption": False, "max_connections_per_peer": PER_PEER}
    set_wan(args, 200, 10)
    deployed = deploy_app(serve_instance, "sec", args)
    yield deployed
    deployed.delete()


def prefill(app) -> dict:
    info = vars(app.handle("Prefill").describe.remote().result())
    address = block_servers.address_of(info["replica_id"])
    assert address is not None
    return {**info, "block_server": address}


def data_plane(app) -> dict:
    return app.handle("Prefill").data_plane_state.remote().result()


def closed_unanswered(address: tuple[str, int], first_bytes: bytes, source: str = "127.0.0.1") -> bool:
    """Whether a plaintext client sending `first_bytes` is closed on without an answer."""
    with socket.create_connection(address, timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(first_bytes)
        try:
            return sock.recv(1024) == b""
        except ConnectionResetError:
            return True


def frame(msg: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return struct.pack("!I", len(body)) + body


def wire_overhead(app, direction: str, prompt: list[int], mode: str) -> tuple[int, int]:
    """(KV bytes the pull reported, bytes the link carried beyond them)."""
    before = Faults(app.name).link_counters(direction)["bytes_down"]
    _, journey = completion(app, prompt, 4, mode=mode)
    moved = Faults(app.name).link_counters(direction)["bytes_down"] - before
    (transfer,) = [t for t in journey["transfers"] if t["link"] == direction]
    assert transfer["ok"] and transfer["bytes"] > 0, journey["transfers"]
    return transfer["bytes"], moved - transfer["bytes"]


def test_pulls_inside_a_datacenter_go_in_plaintext_and_across_the_wan_encrypted(app):
    """TLS 1.3 adds 22 bytes to every record of at most 16 KiB: the WAN's pull carries them,
    the intra-datacenter pull (encryption off) carries only the handshake and header."""
    nbytes, extra = wire_overhead(app, INTRA, fresh(2000), "pd_intra_dc")
    records = math.ceil(nbytes / 16384) * 22
    assert extra < records, (nbytes, extra)
    nbytes, extra = wire_overhead(app, WAN, fresh(2000), "pd_cross_dc_naive")
    assert extra >= math.ceil(nbytes / 16384) * 22, (nbytes, extra)


def test_strangers_are_dropped_in_the_handshake_on_every_data_plane_port(app):
    """No certificate (a well-formed request frame, a pull naming a lease), another cluster's
    certificate, or this cluster's CA with a foreign certificate: nothing is served."""
    p = prefill(app)
    token_port = (p["node_ip"], p["token_port"])
    assert closed_unanswered(token_port, frame(EngineRequest("hostile", fresh(300), SamplingOptions(max_tokens=8))))
    assert closed_unanswered(p["block_server"], frame(PullRequest(secrets.token_urlsafe(16), [0], "hostile")))
    other = Credentials.generate()
    for stranger in (ClusterTLS(other), ClusterTLS(Credentials(ca=cluster_credentials().ca, cert=other.cert, key=other.key))):
        assert not release_lease(p["block_server"], secrets.token_urlsafe(16), stranger.client)
        client = TokenStreamClient(*token_port, stranger.client)
        with pytest.raises(ConnectionError):
            asyncio.run(_first_delta(client, EngineRequest("stranger", fresh(300), SamplingOptions(max_tokens=4))))
    if p["node_ip"] != "127.0.0.1":  # bound to the node's address, not every interface
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", p["token_port"]), timeout=5).close()


async def _first_delta(client: TokenStreamClient, request: EngineRequest):
    try:
        async for delta in client.stream(request):
            return delta
    finally:
        await client.close()


def a_real_lease(p: dict) -> dict:
    """A lease as the conductor gets one: a one-token prefill that keeps its blocks for one consumer."""
    client = TokenStreamClient(p["node_ip"], p["token_port"], cluster_tls().client)
    request = EngineRequest(
        "sec-lease-" + secrets.token_hex(4), fresh(300), SamplingOptions(max_tokens=1, temperature=0), kv_transfer_params={PRODUCE: {"consumers": 1}}
    )
    delta = asyncio.run(_first_delta(client, request))
    return delta.kv_transfer_params[LEASE]


def test_a_rogue_member_is_refused_at_once_and_leaks_nothing_while_legitimate_requests_keep_their_tokens(app):
    p = prefill(app)
    prompts = [fresh(600) for _ in range(3)]
    references = [completion(app, prompt, 48, mode="colocated")[0] for prompt in prompts]
    baseline = data_plane(app)
    (server_before,) = baseline["block_servers"]

    def legitimate() -> list[str]:
        return [completion(app, prompt, 48)[0] for prompt in prompts]

    def guessed(_: int) -> float:
        """A pull naming a guessed lease, from the rogue's own address (within its connection bound)."""
        t0 = time.monotonic()
        raw = socket.create_connection(p["block_server"], timeout=10, source_address=(HOSTILE_SOURCE, 0))
        with cluster_tls().client.wrap_socket(raw, server_hostname=PEER_NAME) as sock:
            _send_msg(sock, PullRequest(secrets.token_urlsafe(32), [0], "rogue"))
            header = _recv_msg(sock, PullHeader)
        assert not header.ok and header.lease_gone
        return time.monotonic() - t0

    with ThreadPoolExecutor(4) as pool:
        served = pool.submit(legitimate)
        # a flood of guessed leases: each answered at once, none holding a thread
        # half its bound at once: a server thread counts its connection until it ends, just after the answer
        with ThreadPoolExecutor(PER_PEER // 2) as flood:
            waits = list(flood.map(guessed, range(200)))
        assert max(waits) < 1.5, sorted(waits)[-5:]
        # a replayed lease: served once, then refused at once
        lease = a_real_lease(p)
        address = (lease["host"], int(lease["port"]))
        assert release_lease(address, lease["lease_id"], cluster_tls().client)
        t0 = time.monotonic()
        assert not release_lease(address, lease["lease_id"], cluster_tls().client)
        assert time.monotonic() - t0 < 1.0
        # an oversized frame on the token channel: cut off at its length prefix
        assert _oversized_frame_is_cut_off((p["node_ip"], p["token_port"]))
        # the WAN relay asked for a host that is no block server
        host, port = app.handle(links_deployment("dc-b")).describe.remote().result()[WAN]
        refused = Faults(app.name).link_counters(WAN)["refused"]
        assert closed_unanswered((host, port), b"127.0.0.1:22\n")
        assert Faults(app.name).link_counters(WAN)["refused"] == refused + 1
        # more connections than one peer may hold: the excess closed at once
        held = [socket.create_connection(p["block_server"], timeout=5, source_address=(HOSTILE_SOURCE, 0)) for _ in range(PER_PEER)]
        try:
            _wait(lambda: data_plane(app)["block_servers"][0]["open_connections"] >= server_before["open_connections"] + PER_PEER)
            for _ in range(3):  # a server that let them in would wait out its 5 s handshake timeout
                t0 = time.monotonic()
                assert closed_unanswered(p["block_server"], b"\x16", source=HOSTILE_SOURCE)
                assert time.monotonic() - t0 < 2.0
        finally:
            for sock in held:
                sock.close()
        assert served.result(timeout=600) == references

    (server_after,) = data_plane(app)["block_servers"]
    assert server_after["refused_connections"] == server_before["refused_connections"] + 3
    assert _wait(lambda: data_plane(app)["block_servers"][0]["open_connections"] == server_before["open_connections"])
    assert _wait(lambda: data_plane(app)["block_servers"][0]["leases"] == 0)
    # the flood's 200 connections each had a thread; all ended (a few of vLLM's own may start lazily)
    assert _wait(lambda: data_plane(app)["block_servers"][0]["threads"] <= server_before["threads"] + 4)


def _oversized_frame_is_cut_off(address: tuple[str, int]) -> bool:
    raw = socket.create_connection(address, timeout=10)
    with cluster_tls().client.wrap_socket(raw, server_hostname=PEER_NAME) as sock:
        sock.sendall(_LEN.pack(MAX_REQUEST_FRAME_BYTES + 1))
        try:  # a server reading on would wait for 16 MiB: the recv would time out, failing the test
            return sock.recv(1024) == b""
        except (ConnectionResetError, ssl.SSLEOFError):
            return True


def _wait(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
