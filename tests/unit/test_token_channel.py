"""The token channel over real loopback sockets and real mutual TLS, with a scripted token source."""

import asyncio
import ssl

import pytest

from app.engine.cluster_tls import PEER_NAME, ClusterTLS, Credentials
from app.engine.kv.limits import ConnectionLimits
from app.engine.token_channel import (
    _LEN,
    MAX_REQUEST_FRAME_BYTES,
    ChannelClosed,
    EngineDelta,
    EngineRequest,
    SamplingOptions,
    TokenStreamClient,
    TokenStreamServer,
    _encoder,
)

CREDENTIALS = Credentials.generate()
TLS = ClusterTLS(CREDENTIALS)


def limits(per_peer=8, total=16):
    return ConnectionLimits("token channel", per_peer, total)


class ScriptedEngine:
    """Emits max_tokens tokens (1, 2, 3, ...) with a small delay; records aborts."""

    def __init__(self, delay=0.001):
        self.delay = delay
        self.cancelled: list[str] = []
        self.started: list[str] = []

    async def __call__(self, req: EngineRequest):
        self.started.append(req.request_id)
        try:
            n = req.sampling.max_tokens
            for i in range(n):
                await asyncio.sleep(self.delay)
                if req.prompt_token_ids == [666] and i == 2:
                    raise RuntimeError("engine exploded")
                yield EngineDelta(request_id=req.request_id, token_ids=[i + 1], finished=i == n - 1, finish_reason="length" if i == n - 1 else None)
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


def _req(rid, n=5, prompt=(1, 2)):
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingOptions(max_tokens=n))


async def _collect(client, req):
    return [d async for d in client.stream(req)]


async def test_many_streams_share_one_connection_in_order():
    engine = ScriptedEngine()
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, limits())
    port = await server.start()
    client = TokenStreamClient("127.0.0.1", port, TLS.client)
    results = await asyncio.gather(*(_collect(client, _req(f"r{i}", n=10 + i)) for i in range(20)))
    for i, deltas in enumerate(results):
        assert [t for d in deltas for t in d.token_ids] == list(range(1, 11 + i))
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert all(d.request_id == f"r{i}" for d in deltas)
    await client.close()
    await server.close()


async def test_leaving_early_aborts_the_engine_request():
    engine = ScriptedEngine(delay=0.01)
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, limits())
    client = TokenStreamClient("127.0.0.1", await server.start(), TLS.client)
    got = []
    async for d in client.stream(_req("early", n=1000)):
        got.extend(d.token_ids)
        if len(got) >= 3:
            break
    for _ in range(100):
        if "early" in engine.cancelled:
            break
        await asyncio.sleep(0.01)
    assert engine.cancelled == ["early"]
    assert client.active_streams == 0
    await client.close()
    await server.close()


async def test_engine_error_arrives_in_band():
    server = TokenStreamServer(ScriptedEngine(), "127.0.0.1", TLS.server, limits())
    client = TokenStreamClient("127.0.0.1", await server.start(), TLS.client)
    deltas = await _collect(client, _req("boom", n=10, prompt=[666]))
    assert deltas[-1].finished and deltas[-1].finish_reason == "error"
    assert "engine exploded" in deltas[-1].error
    # the connection survives one request's failure
    assert [t for d in await _collect(client, _req("after", n=3)) for t in d.token_ids] == [1, 2, 3]
    await client.close()
    await server.close()


async def test_server_going_away_fails_open_streams():
    engine = ScriptedEngine(delay=0.01)
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, limits())
    client = TokenStreamClient("127.0.0.1", await server.start(), TLS.client)

    async def consume():
        return await _collect(client, _req("cut", n=10_000))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    await server.close()
    # closing the listening socket does not drop accepted connections; kill ours
    for t in asyncio.all_tasks():
        if t.get_coro().__qualname__.startswith("TokenStreamServer._serve_connection"):
            t.cancel()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(task, 5)
    await client.close()


async def test_unreachable_engine_is_a_channel_error():
    client = TokenStreamClient("127.0.0.1", 1, TLS.client, connect_timeout_s=1)
    with pytest.raises(ChannelClosed, match="cannot reach"):
        await _collect(client, _req("x"))


async def test_duplicate_request_id_rejected():
    server = TokenStreamServer(ScriptedEngine(delay=0.05), "127.0.0.1", TLS.server, limits())
    client = TokenStreamClient("127.0.0.1", await server.start(), TLS.client)
    first = client.stream(_req("dup", n=50))
    await first.__anext__()
    with pytest.raises(ValueError, match="already streaming"):
        await client.stream(_req("dup")).__anext__()
    await first.aclose()
    await client.close()
    await server.close()


async def test_a_client_without_the_clusters_certificate_runs_nothing():
    """A plaintext client that writes a well-formed request, a TLS client of another
    cluster, and one that trusts this cluster's CA but presents another's certificate:
    each is dropped in the handshake; the engine never sees a request."""
    engine = ScriptedEngine()
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, limits())
    port = await server.start()

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = _encoder.encode(_req("plaintext"))
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
    writer.close()

    other = Credentials.generate()
    for tls in (ClusterTLS(other), ClusterTLS(Credentials(ca=CREDENTIALS.ca, cert=other.cert, key=other.key))):
        stranger = TokenStreamClient("127.0.0.1", port, tls.client)
        with pytest.raises(ChannelClosed):
            await _collect(stranger, _req("stranger"))
        await stranger.close()

    assert engine.started == []
    client = TokenStreamClient("127.0.0.1", port, TLS.client)  # the cluster's own still served
    assert [t for d in await _collect(client, _req("member", n=3)) for t in d.token_ids] == [1, 2, 3]
    await client.close()
    await server.close()


async def test_an_oversized_request_frame_closes_its_connection_before_it_is_read(caplog):
    """A member announcing a frame over the request limit is cut off at the length prefix
    (nothing buffered), with a warning naming the size; other connections go on."""
    engine = ScriptedEngine()
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, limits())
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=TLS.client, server_hostname=PEER_NAME)
    writer.write(_LEN.pack(MAX_REQUEST_FRAME_BYTES + 1))
    await writer.drain()
    with caplog.at_level("WARNING"):
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert f"a frame of {MAX_REQUEST_FRAME_BYTES + 1} bytes, over the {MAX_REQUEST_FRAME_BYTES}-byte limit" in caplog.text
    writer.close()
    client = TokenStreamClient("127.0.0.1", port, TLS.client)
    assert [t for d in await _collect(client, _req("after", n=2)) for t in d.token_ids] == [1, 2]
    assert engine.started == ["after"]
    await client.close()
    await server.close()


async def test_connections_beyond_a_peers_bound_are_closed_and_freed_slots_reopen():
    engine = ScriptedEngine()
    bounds = limits(per_peer=2)
    server = TokenStreamServer(engine, "127.0.0.1", TLS.server, bounds)
    port = await server.start()
    clients = [TokenStreamClient("127.0.0.1", port, TLS.client) for _ in range(3)]
    for client in clients[:2]:
        await _collect(client, _req("in", n=1))
    with pytest.raises((ChannelClosed, ssl.SSLError)):
        await _collect(clients[2], _req("over", n=1))
    assert bounds.refused == 1 and bounds.open == 2
    await clients[0].close()
    for _ in range(100):  # the server sees the close on its next read
        if bounds.open == 1:
            break
        await asyncio.sleep(0.01)
    again = TokenStreamClient("127.0.0.1", port, TLS.client)
    assert [t for d in await _collect(again, _req("again", n=2)) for t in d.token_ids] == [1, 2]
    for client in (*clients[1:], again):
        await client.close()
    await server.close()
