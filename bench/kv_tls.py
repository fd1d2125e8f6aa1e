"""The encrypted column of bench/kv_transfer.py: KV pulls with mutual TLS vs plaintext.

Transport level, with the product's own parts and no Ray or engines: one
BlockServer (`allow_plaintext=True`) serving leases of real torch tensors laid
out as the dev model's paged KV cache (2 layers of [blocks, 4 KV heads, 32
tokens, K and V of 64 dims] float32, vLLM's CPU layout: 128 KiB a block, 4 KiB
a token), a LinkRelay on its own event-loop thread pacing to a LinkConfig, and
pull_blocks from this thread into a second such cache. Both modes use the same
server, relay, tensors, blocks, thread model and mutual-TLS handshake; only
`PullSpec.plaintext` differs: a TLS pull keeps the blocks inside the session, a
plaintext one closes TLS after the request and header and sends the blocks in
the clear (what `security.intra_dc_encryption: false` allows inside a
datacenter; here it is the baseline).

- WAN: `--bandwidth-mbps` / `--rtt-ms` (40 Mbit/s, 30 ms), no jitter (it would
  only add noise to a 3% comparison). Pulls of 64 blocks: a 2048-token prompt's
  KV for the dev model (8 MiB), what kv_transfer.py's 0%-hit turn sends, about
  1.7 s on the link. Ratio: median TLS time / median plaintext time; goal <= 1.03.
- Intra-DC: serve_configs/local.yaml's dc-a <-> dc-a link (20 Gbit/s, 0.1 ms
  RTT), pulls of 1024 blocks (128 MiB). Through the relay (what the product
  emulates: `tls_intra_throughput_ratio`) and directly to the block server (TLS's
  own cost without the Python relay's cap: `tls_intra_direct_throughput_ratio`).
  Ratio: median TLS throughput / median plaintext throughput. The Python relay
  may itself cap the rate far below the link's figure (it pauses after every
  64 KiB chunk, and asyncio's sleeps wait at least epoll's 1 ms): then its
  ratio shows TLS at the rate the emulator delivers, and the direct one what
  encryption costs on this host's cores.

A pull's time is PullResult.seconds: connect, handshake, request and every
block written into the destination cache. Pairs alternate which mode goes
first; one unmeasured pull of each mode warms up each path. Everything runs in
one process (server threads, relay loop, puller) on this host's cores, as the
unit tests run it. The emulator delays only the first byte coming back by the
RTT, so a plaintext pull's extra round trip on a real WAN (the server waits
for the puller's close_notify before sending blocks) is not charged here.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading

import torch
from rich.console import Console
from rich.table import Table

from app.config import LinkConfig
from app.engine.cluster_tls import PEER_NAME, ClusterTLS, Credentials
from app.engine.kv.leases import LeaseIds, LeaseTable
from app.engine.kv.limits import ConnectionLimits
from app.engine.kv.link import LinkModel, LinkRelay
from app.engine.kv.transport import BlockServer, KVLayout, PullResult, PullSpec, pull_blocks

LAYERS, BLOCK_SHAPE = 2, (4, 32, 128)  # the dev model, per layer and block (KV heads, tokens, K+V dims)
WAN_BLOCKS = 64  # 2048 tokens
INTRA_BLOCKS = 1024  # 128 MiB
INTRA_LINK = LinkConfig(between=("dc-a", "dc-a"), bandwidth_mbps=20000, rtt_ms=0.1)
WAN_GOAL = 1.03
HOST = "127.0.0.1"


def dev_caches(blocks: int, seed: int) -> KVLayout:
    g = torch.Generator().manual_seed(seed)
    return KVLayout.from_caches({f"layer.{i}": torch.randn(blocks, *BLOCK_SHAPE, generator=g) for i in range(LAYERS)}, blocks)


class RelayThread:
    """A LinkRelay forwarding to one block server, on its own event loop thread."""

    def __init__(self, config: LinkConfig, block_server: tuple[str, int]):
        async def allowed(address: tuple[str, int]) -> bool:
            return address == block_server

        self.loop = asyncio.new_event_loop()
        self.relay = LinkRelay("bench", LinkModel(config), HOST, allowed)
        threading.Thread(target=self.loop.run_forever, name="bench-relay", daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self.relay.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Rig:
    """The block server with INTRA_BLOCKS of source KV, and the destination cache."""

    def __init__(self) -> None:
        credentials = Credentials.generate()
        self.tls = ClusterTLS(credentials)
        self.ids = LeaseIds.for_block_server(credentials.key, (HOST, 0))
        self.leases = LeaseTable()
        self.src, self.dst = dev_caches(INTRA_BLOCKS, 1), dev_caches(INTRA_BLOCKS, 2)
        limits = ConnectionLimits("bench block server", 64, 256)
        self.server = BlockServer(lambda: self.src, self.leases, self.ids, (HOST, 0), self.tls.server, limits, allow_plaintext=True)
        self.address = (HOST, self.server.port)

    def cipher(self) -> str:
        """The suite a handshake with the block server agrees on (it then drops the connection: no request)."""
        with socket.create_connection(self.address, timeout=10) as raw, self.tls.client.wrap_socket(raw, server_hostname=PEER_NAME) as sock:
            return f"{sock.version()} {sock.cipher()[0]}"

    def pull(self, blocks: int, relay: RelayThread | None, plaintext: bool) -> tuple[PullResult, int | None]:
        """One pull of the first `blocks` blocks; with the bytes the relay carried down."""
        lease_id = self.ids.issue()
        self.leases.add(lease_id, list(range(blocks)), consumers=1, ttl_s=600)
        before = relay.relay.counters.bytes_down if relay else 0
        ids = list(range(blocks))
        spec = PullSpec("bench", lease_id, self.address, (HOST, relay.port) if relay else None, "bench", ids, ids, plaintext=plaintext)
        result = pull_blocks(spec, self.dst, self.tls.client, 10, 600)
        if not result.ok:
            raise RuntimeError(f"{'plaintext' if plaintext else 'TLS'} pull failed: {result.error}")
        self.leases.take_done()
        return result, (relay.relay.counters.bytes_down - before if relay else None)

    def close(self) -> None:
        self.server.close()


def alternate(rig: Rig, section: str, path: str, blocks: int, relay: RelayThread | None, repeats: int) -> list[dict]:
    """`repeats` pairs of pulls, one per mode, alternating which goes first."""
    for plaintext in (False, True):  # warm-up: page faults, first handshakes
        rig.pull(blocks, relay, plaintext)
    rows = []
    for rep in range(repeats):
        for plaintext in (False, True) if rep % 2 == 0 else (True, False):
            result, wire = rig.pull(blocks, relay, plaintext)
            rows.append(
                {
                    "section": section,
                    "path": path,
                    "repeat": rep,
                    "tls": not plaintext,
                    "bytes": result.bytes,
                    "wire_bytes": wire,
                    "seconds": result.seconds,
                    "bytes_per_s": result.bytes / result.seconds,
                }
            )
    return rows


def stats(rows: list[dict], section: str, path: str, key: str) -> dict:
    """Median and range of `key` per mode, and TLS / plaintext of the medians and of each pair."""
    out = {}
    for tls in (True, False):
        values = [r[key] for r in rows if r["section"] == section and r["path"] == path and r["tls"] == tls]
        out["tls" if tls else "plain"] = {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}
    out["ratio"] = out["tls"]["median"] / out["plain"]["median"]
    pairs = [t / p for t, p in zip(out["tls"]["values"], out["plain"]["values"])]
    out["pair_ratio_min"], out["pair_ratio_max"] = min(pairs), max(pairs)
    return out


def run(bandwidth_mbps: float, rtt_ms: float, repeats: int, console: Console) -> tuple[list[dict], dict]:
    """Measure both sections; rows for the CSV and the summary (its keys start with `tls_`)."""
    wan_link = LinkConfig(between=("dc-a", "dc-b"), bandwidth_mbps=bandwidth_mbps, rtt_ms=rtt_ms)
    rig = Rig()
    rows: list[dict] = []
    try:
        cipher = rig.cipher()
        for section, path, link, blocks in (
            ("wan", "relay", wan_link, WAN_BLOCKS),
            ("intra", "relay", INTRA_LINK, INTRA_BLOCKS),
            ("intra", "direct", None, INTRA_BLOCKS),
        ):
            relay = RelayThread(link, rig.address) if link else None
            try:
                console.print(f"TLS vs plaintext: {section} via {path}, {repeats} pairs of {blocks * rig.src.block_nbytes / 2**20:.0f} MiB pulls")
                rows += alternate(rig, section, path, blocks, relay, repeats)
            finally:
                if relay:
                    relay.close()
        intact = all(torch.equal(rig.dst.tensors[n], t) for n, t in rig.src.tensors.items())
    finally:
        rig.close()

    wan = stats(rows, "wan", "relay", "seconds")
    wire = stats(rows, "wan", "relay", "wire_bytes")
    intra = {path: stats(rows, "intra", path, "bytes_per_s") for path in ("relay", "direct")}
    goal_met = wan["ratio"] <= WAN_GOAL

    def gbit(v: float) -> str:
        return f"{v * 8 / 1e9:.2f}"

    def cells(s: dict, fmt) -> list[str]:
        return [f"{fmt(s[m]['median'])} [{fmt(s[m]['min'])}-{fmt(s[m]['max'])}]" for m in ("plain", "tls")] + [
            f"{s['ratio']:.3f}x",
            f"{s['pair_ratio_min']:.3f}-{s['pair_ratio_max']:.3f}",
        ]

    table = Table(
        title=f"KV pulls with mutual TLS ({cipher}) vs plaintext, medians \\[min-max] of {repeats} alternating pairs",
        caption="Both modes: the same block server, relay, source and destination tensors, puller thread and TLS handshake; "
        "only PullSpec.plaintext differs (blocks outside TLS after the request).",
    )
    for col in ("measure", "link", "pull", "plaintext", "TLS", "TLS / plaintext", "per pair"):
        table.add_column(col, justify="right")
    wan_label = f"{bandwidth_mbps:g} Mbit/s, {rtt_ms:g} ms, via relay"
    wan_mib = f"{WAN_BLOCKS * rig.src.block_nbytes / 2**20:.0f} MiB"
    table.add_row("WAN pull time (ms)", wan_label, wan_mib, *cells(wan, lambda v: f"{v * 1000:,.0f}"))
    table.add_row("WAN bytes on the link (MB)", wan_label, wan_mib, *cells(wire, lambda v: f"{v / 1e6:.3f}"))
    intra_mib = f"{INTRA_BLOCKS * rig.src.block_nbytes / 2**20:.0f} MiB"
    table.add_row("intra-DC throughput (Gbit/s)", "20 Gbit/s, 0.1 ms, via relay", intra_mib, *cells(intra["relay"], gbit))
    table.add_row("intra-DC throughput (Gbit/s)", "direct, no relay", intra_mib, *cells(intra["direct"], gbit))
    console.print(table)
    console.print(
        f"WAN pull time TLS / plaintext: {wan['ratio']:.3f}x (goal <= {WAN_GOAL}x: {'met' if goal_met else 'NOT met'}); "
        f"intra-DC throughput TLS / plaintext: {intra['relay']['ratio']:.3f}x via the relay (tls_intra_throughput_ratio), "
        f"{intra['direct']['ratio']:.3f}x direct; TLS via the relay moves {intra['relay']['tls']['median'] * 8 / 20e9:.1%} of the link's 20 Gbit/s; "
        f"destination cache {'identical to' if intact else 'DIFFERS from'} the source"
    )
    if not intact:
        raise RuntimeError("pulled blocks differ from the source")

    def medians(s: dict) -> dict:
        return {m: {k: s[m][k] for k in ("median", "min", "max")} for m in ("tls", "plain")}

    summary = {
        "tls_wan_time_ratio": wan["ratio"],
        "tls_wan_goal_met": goal_met,
        "tls_intra_throughput_ratio": intra["relay"]["ratio"],
        "tls_intra_direct_throughput_ratio": intra["direct"]["ratio"],
        "tls_wan_seconds": medians(wan),
        "tls_wan_wire_bytes": medians(wire),
        "tls_intra_relay_bytes_per_s": medians(intra["relay"]),
        "tls_intra_direct_bytes_per_s": medians(intra["direct"]),
        "tls_repeats": repeats,
        "tls_cipher": cipher,
        "tls_wan_pull_bytes": WAN_BLOCKS * rig.src.block_nbytes,
        "tls_intra_pull_bytes": INTRA_BLOCKS * rig.src.block_nbytes,
    }
    return rows, summary
