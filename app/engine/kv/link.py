"""Link emulation on the real byte stream: a TCP relay per direction, paced by a link model.

Linux `tc netem` is unavailable here, so links are emulated in user space: a
decoder's KV pull connects to the relay of its (source -> destination)
datacenter pair, names the prefill replica it wants, and the relay forwards
the bytes both ways, holding the data coming back to the model's RTT, jitter,
stalls and bandwidth. Cutting a link closes its live connections and refuses
new ones until the cut ends, so decoders see real mid-transfer failures.

A relay forwards only to registered block servers (app/engine/kv/block_servers.py),
and what it forwards is the pull's TLS session, end to end: it reads nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from app.config import LinkConfig, PullOrder, SecurityConfig
from app.engine.kv.limits import ConnectionLimits

logger = logging.getLogger(__name__)

#: Bytes forwarded per pacing step: small enough for smooth pacing, large
#: enough that Python's per-chunk cost stays far below the emulated rates.
CHUNK_BYTES = 64 * 1024
PREAMBLE_LIMIT = 512
#: How far the relay may run ahead of (or make up behind) the link's pacing, in seconds.
PACE_SLACK_S = 0.003
#: A connection that names no block server within this is dropped.
PREAMBLE_TIMEOUT_S = 5.0

Allowed = Callable[[tuple[str, int]], Awaitable[bool]]


def direction_name(src_dc: str, dst_dc: str) -> str:
    return f"{src_dc}->{dst_dc}"


class LinkModel:
    """Seeded draws of one transfer's latency, stall and pacing from a LinkConfig."""

    def __init__(self, config: LinkConfig, seed_salt: int = 0):
        self.config = config
        self._rng = random.Random(config.seed * 1_000_003 + seed_salt)

    @property
    def bytes_per_s(self) -> float:
        return self.config.bytes_per_s

    def jitter_s(self) -> float:
        j = self.config.jitter
        if j.distribution == "none" or j.mean_ms <= 0:
            return 0.0
        if j.distribution == "normal":
            draw = self._rng.gauss(j.mean_ms, j.std_ms)
        elif j.distribution == "lognormal":
            # parameters chosen so the draw's mean and std are mean_ms and std_ms
            var = math.log(1 + (j.std_ms / j.mean_ms) ** 2)
            draw = self._rng.lognormvariate(math.log(j.mean_ms) - var / 2, math.sqrt(var))
        elif j.distribution == "exponential":
            draw = self._rng.expovariate(1 / j.mean_ms)
        else:  # pareto with the given mean
            scale = j.mean_ms * (j.pareto_shape - 1) / j.pareto_shape
            draw = scale * self._rng.paretovariate(j.pareto_shape)
        return min(max(draw, 0.0), j.max_ms) / 1000

    def first_byte_delay_s(self) -> float:
        return self.config.rtt_ms / 1000 + self.jitter_s()

    def stall_s(self) -> float:
        """Seconds this transfer pauses after its first chunk (0: no stall)."""
        s = self.config.stall
        if s.probability <= 0 or s.duration_ms <= 0 or self._rng.random() >= s.probability:
            return 0.0
        return s.duration_ms / 1000

    def transfer_seconds(self, nbytes: int) -> float:
        """What an idle link needs for one pull of `nbytes` (no jitter, no stall)."""
        return self.config.rtt_ms / 1000 + nbytes / self.bytes_per_s

    def with_figures(self, **figures: float) -> LinkModel:
        """The same link at other figures (e.g. `bandwidth_mbps`), validated, drawing from the same seeded stream."""
        model = LinkModel(LinkConfig.model_validate({**self.config.model_dump(), **figures}))
        model._rng = self._rng
        return model


class LinkShare:
    """The configured link as a fluid model of the pulls on it: each decoder moves up to
    `slots` pulls at once (its pull threads; the rest wait in `order`), and the pulls
    moving share the bandwidth equally (as the emulator's interleaved chunks and TCP
    flows do). A pull's real time against the time it needs here tells a slow link
    from a busy one; against an idle link's time, four pulls moving together read as
    four times slower.

    A pull stays in the model until the model has moved its bytes, whatever its real
    end, as in policy.LinkBacklog; and, as there, no longer than its real bytes once
    its decoder says what it moved (`settle`)."""

    KEEP_FINISHED = 4096
    """Pulls the model finished that were not reported yet (a cancelled pull never is)."""

    def __init__(self, bytes_per_s: float, slots: int = 8, order: PullOrder = PullOrder.smallest_first):
        self.bytes_per_s = bytes_per_s
        self.slots = slots
        self.order = order
        self._left: dict[str, float] = {}
        """Pulls moving in the model -> bytes it has not moved yet."""
        self._moving_since: dict[str, float] = {}
        """Pulls moving in the model and not reported yet -> when they began to move."""
        self._destination: dict[str, str] = {}
        self._waiting: dict[str, list[tuple[float, int, str]]] = {}
        """Destination -> pulls waiting for one of its slots: (order key, arrival, pull)."""
        self._bytes: dict[str, float] = {}
        self._arrivals = itertools.count()
        self._finished: dict[str, float] = {}
        """Pulls the model finished and not reported yet -> seconds they moved."""
        self._at = 0.0

    def start(self, pull: str, nbytes: int, now: float, destination: str = "") -> None:
        self._advance(now)
        self._destination[pull] = destination
        self._bytes[pull] = float(nbytes)
        key = float(nbytes) if self.order is PullOrder.smallest_first else 0.0
        heapq.heappush(self._waiting.setdefault(destination, []), (key, next(self._arrivals), pull))
        self._admit(destination, now)

    def finish(self, pull: str, now: float) -> float | None:
        """Seconds `pull` moves in the model, its wait for a slot left out as in a
        transfer's `seconds` (one still moving or waiting: as if no other pull joined
        from `now` on); None for a pull it never started."""
        self._advance(now)
        if pull in self._finished:
            return self._finished.pop(pull)
        if pull in self._moving_since:
            return now - self._moving_since.pop(pull) + self._left[pull] * len(self._left) / self.bytes_per_s
        if pull in self._bytes:  # still waiting for a slot in the model
            return self._bytes[pull] * (len(self._left) + 1) / self.bytes_per_s
        return None

    def settle(self, pull: str, moved: int, now: float) -> None:
        """`pull` moved `moved` bytes in all (its report, or its first token without one):
        the model moves no more of it than that, and expects no report for it."""
        self._advance(now)
        self._moving_since.pop(pull, None)
        self._finished.pop(pull, None)
        planned = self._bytes.get(pull)
        if planned is None or moved >= planned:
            return
        self._bytes[pull] = float(moved)
        if pull in self._left:
            self._left[pull] -= planned - moved
            if self._left[pull] <= 1e-6:
                del self._left[pull]
                del self._bytes[pull]
                self._admit(self._destination.pop(pull), now)

    def _admit(self, destination: str, at: float) -> None:
        waiting = self._waiting.get(destination)
        moving = sum(1 for p in self._left if self._destination[p] == destination)
        while waiting and moving < self.slots:
            _, _, pull = heapq.heappop(waiting)
            self._left[pull] = self._bytes[pull]
            self._moving_since[pull] = at
            moving += 1

    def _advance(self, now: float) -> None:
        t, self._at = self._at, max(now, self._at)
        while self._left and t < self._at:
            share = self.bytes_per_s / len(self._left)
            step = min(self._at - t, min(self._left.values()) / share)
            t += step
            for pull in list(self._left):
                self._left[pull] -= step * share
                if self._left[pull] <= 1e-6:
                    del self._left[pull]
                    del self._bytes[pull]
                    if pull in self._moving_since:
                        self._finished[pull] = t - self._moving_since.pop(pull)
                    self._admit(self._destination.pop(pull), t)
        while len(self._finished) > self.KEEP_FINISHED:
            self._finished.pop(next(iter(self._finished)))


@dataclass
class LinkCounters:
    connections: int = 0
    bytes_down: int = 0
    """Bytes from the source datacenter to the destination (KV data)."""
    cut_connections: int = 0
    refused: int = 0
    """Connections that named no registered block server."""


@dataclass
class _Cut:
    until: float = 0.0  # monotonic time; inf for "until restored"

    def active(self) -> bool:
        return time.monotonic() < self.until


class LinkRelay:
    """One direction of one link: forwards pulls from destination-side decoders to sources."""

    def __init__(self, name: str, model: LinkModel, host: str, allowed: Allowed, security: SecurityConfig | None = None):
        """`allowed(address)`: whether `address` is a block server this relay may forward to."""
        security = security or SecurityConfig()
        self.name = name
        self.limits = ConnectionLimits(f"link relay {name}", security.max_connections_per_peer, security.max_connections)
        self._allowed = allowed
        self.model = self._configured = model
        self._host = host
        self._server: asyncio.AbstractServer | None = None
        self.port: int | None = None
        self.counters = LinkCounters()
        self._cut = _Cut()
        self._live: set[asyncio.StreamWriter] = set()
        self._free_at = 0.0  # when the link's bandwidth is next free (pulls share it)
        self._stalled_until = 0.0
        self._stall_lifted = asyncio.Event()  # wakes transfers held by a stall that `restore` ended

    async def start(self) -> int:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self._host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
        assert self.port is not None
        return self.port

    def update(self, model: LinkModel) -> None:
        """A new configured model (a reconfigure also ends a `degrade`)."""
        self.model = self._configured = model

    def degrade(self, **figures: float) -> None:
        """Run at other figures than configured (a congested or rerouted path: e.g.
        `bandwidth_mbps=4`) until `restore`. Routing still plans with the configured
        figures, as it would when a real WAN degrades unannounced."""
        self.model = self._configured.with_figures(**figures)

    def cut(self, seconds: float | None) -> None:
        """Sever the link for `seconds` (None: until `restore`), dropping live pulls."""
        self._cut.until = math.inf if seconds is None else time.monotonic() + seconds
        for writer in list(self._live):
            self.counters.cut_connections += 1
            writer.transport.abort()

    def restore(self) -> None:
        """End any cut, stall or degradation."""
        self._cut.until = 0.0
        self._stalled_until = 0.0
        self._stall_lifted.set()
        self.model = self._configured

    def stall(self, seconds: float) -> None:
        """Hold every transfer's data for `seconds`; connections stay open (a congested path)."""
        self._stalled_until = time.monotonic() + seconds
        self._stall_lifted.clear()

    @property
    def is_cut(self) -> bool:
        return self._cut.active()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        peer = str(client_w.get_extra_info("peername")[0])
        if self._cut.active() or not self.limits.admit(peer):
            client_w.transport.abort()
            return
        try:
            await self._relay(client_r, client_w)
        finally:
            self.limits.release(peer)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        target_w = None
        try:
            line = await asyncio.wait_for(client_r.readuntil(b"\n"), PREAMBLE_TIMEOUT_S)
            host, _, port = line[:PREAMBLE_LIMIT].decode().strip().rpartition(":")
            target = (host, int(port))
            if not await self._allowed(target):
                self.counters.refused += 1
                logger.warning("link %s: refused to relay to %s:%d, not a registered block server", self.name, *target)
                client_w.transport.abort()
                return
            target_r, target_w = await asyncio.open_connection(*target)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            logger.info("link %s: cannot open relay: %s", self.name, exc)
            client_w.transport.abort()
            return
        self._live.update((client_w, target_w))
        up = asyncio.create_task(self._pipe_up(client_r, target_w))
        try:
            await self._pipe_down(target_r, client_w)
        except (ConnectionError, OSError):
            pass
        finally:
            up.cancel()
            self._live.discard(client_w)
            self._live.discard(target_w)
            for w in (client_w, target_w):
                with contextlib.suppress(Exception):
                    w.close()

    async def _pipe_up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Requests from the decoder to the source: small, sent as they come."""
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            while data := await reader.read(CHUNK_BYTES):
                writer.write(data)
                await writer.drain()
            writer.write_eof()

    async def _pipe_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """KV data from the source: first byte after RTT + jitter, then paced; a drawn
        stall pauses the transfer once it has begun."""
        chunks = 0
        stall_s = self.model.stall_s()
        while data := await reader.read(CHUNK_BYTES):
            if chunks == 0:
                await asyncio.sleep(self.model.first_byte_delay_s())
            elif chunks == 1 and stall_s:
                await asyncio.sleep(stall_s)
            chunks += 1
            if (held_s := self._stalled_until - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stall_lifted.wait(), held_s)
            now = time.monotonic()
            # Pulls share the bandwidth: each chunk queues behind what is already on the wire.
            # asyncio sleeps no shorter than ~1 ms, far longer than a fast link's chunk: the
            # relay sleeps only once a few ms ahead, and keeps credit for a sleep's overshoot.
            start = max(now - PACE_SLACK_S, self._free_at)
            self._free_at = start + len(data) / self.model.bytes_per_s
            if self._free_at > now + PACE_SLACK_S:
                await asyncio.sleep(self._free_at - now)
            if self._cut.active():
                raise ConnectionResetError("link cut")
            self.counters.bytes_down += len(data)
            writer.write(data)
            await writer.drain()

    async def close(self) -> None:
        self.cut(0)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


@dataclass
class LinkSet:
    """Relays for every direction of every configured link."""

    relays: dict[str, LinkRelay] = field(default_factory=dict)

    def update(self, configs: list[LinkConfig], host: str, allowed: Allowed, destination: str | None = None, security: SecurityConfig | None = None) -> None:
        """Relays for every direction of `configs` (only those into `destination` when given),
        listening on `host` (the node's address), with `security`'s connection bounds."""
        for i, cfg in enumerate(configs):
            a, b = cfg.between
            for src, dst in {(a, b), (b, a)}:
                if destination is not None and dst != destination:
                    continue
                name = direction_name(src, dst)
                model = LinkModel(cfg, seed_salt=i * 2 + (src > dst))
                if name in self.relays:
                    self.relays[name].update(model)
                else:
                    self.relays[name] = LinkRelay(name, model, host, allowed, security)

    async def start(self) -> dict[str, int]:
        return {name: await relay.start() for name, relay in self.relays.items()}

    async def close(self) -> None:
        for relay in self.relays.values():
            await relay.close()
