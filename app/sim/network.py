"""Links between datacenters: a latency draw per transfer, then bandwidth shared;
and each decoding engine's pull threads, which bound how many of its pulls move at once.

Each transfer (one KV pull) first waits the link's RTT plus a jitter draw and
possibly a stall (drawn by app.engine.kv.link.LinkModel, the same draws the real
link emulation makes), then its bytes flow. Concurrent flows share the
bandwidth equally (processor sharing), as the real relay interleaves chunks of
concurrent pulls. Where the KV transport's own cost was measured
(`set_transport`), each pull first waits that too.

Processor sharing runs in virtual time: `vt` is the bytes each active flow has
received since the link last went idle, growing at bandwidth / active flows;
a flow added at `vt0` with `b` bytes ends when `vt` reaches `vt0 + b`. Adding
or ending a flow is O(log flows) and needs one pending event per link.

A decoding engine runs only so many pulls at once (`PullSlots`, the PDD
connector's pull threads): under a burst of cold prompts the others queue off
the link, in the connector's order, so the pulls on the wire finish sooner than
an equal share of the bandwidth among all of them would let them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import Any

from app.config import LinkConfig, PullOrder
from app.engine.kv.link import LinkModel
from app.sim.events import Loop


class Link:
    __slots__ = ("loop", "model", "bw", "vt", "t_last", "heap", "version", "_order", "bytes", "transfers", "wan", "down", "pull_s", "pull_s_per_byte")

    def __init__(self, loop: Loop, config: LinkConfig, seed: int = 0):
        self.loop = loop
        self.model = LinkModel(config, seed_salt=seed)
        self.bw = self.model.bytes_per_s
        self.vt = 0.0
        self.t_last = 0.0
        self.heap: list[tuple[float, int, tuple[int, Callable[[Any], None], Any]]] = []
        self.version = 0
        self._order = count()
        self.bytes = 0
        self.transfers = 0
        self.wan = config.between[0] != config.between[1]
        self.down: list[tuple[float, float]] = []
        """Windows [start, end) in which the link is cut: a transfer starts after them."""
        self.pull_s = 0.0
        self.pull_s_per_byte = 0.0

    def set_transport(self, pull_s: float, pull_s_per_byte: float) -> None:
        """Each pull also costs the KV transport `pull_s` + `pull_s_per_byte` x its bytes
        (perf.FittedPerf.kv_pull_ms, kv_pull_ms_per_mb). The per-byte part only on a link
        faster than the transport: on a slower one, the link paces the bytes and the
        transport keeps up with it."""
        self.pull_s = pull_s
        self.pull_s_per_byte = pull_s_per_byte if self.bw * pull_s_per_byte > 1 else 0.0

    def send(self, nbytes: int, done: Callable[[Any], None], arg: Any) -> None:
        """Move `nbytes`; call `done(arg)` when the last byte arrived (at once for 0 bytes)."""
        loop = self.loop
        if nbytes <= 0:
            loop.at(loop.now, done, arg)
            return
        self.transfers += 1
        start = loop.now
        for s, e in self.down:
            if s <= start < e:
                start = e
        delay = self.model.first_byte_delay_s() + self.model.stall_s() + self.pull_s + nbytes * self.pull_s_per_byte
        loop.at(start + delay, self._start, (nbytes, done, arg))

    def _advance(self, now: float) -> None:
        n = len(self.heap)
        if n:
            self.vt += (now - self.t_last) * self.bw / n
        self.t_last = now

    def _start(self, flow: tuple[int, Callable[[Any], None], Any]) -> None:
        now = self.loop.now
        self._advance(now)
        heapq.heappush(self.heap, (self.vt + flow[0], next(self._order), flow))
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        self.version += 1
        heap = self.heap
        if heap:
            loop = self.loop
            heapq.heappush(loop.heap, (now + (heap[0][0] - self.vt) * len(heap) / self.bw, next(loop.order), self._finish, self.version))
        else:
            self.vt = 0.0  # re-base while idle: keeps the float sums small

    def _finish(self, version: int) -> None:
        if version != self.version:
            return
        now = self.loop.now
        self._advance(now)
        heap = self.heap
        # this event was the head flow's end; others ending within a nanosecond end with it
        # (float time cannot always resolve the last few bytes of a fast link)
        due = self.vt + 1e-9 * self.bw / len(heap)
        ended = [heapq.heappop(heap)[2]]
        while heap and heap[0][0] <= due:
            ended.append(heapq.heappop(heap)[2])
        self._schedule(now)
        for nbytes, done, arg in ended:
            self.bytes += nbytes
            done(arg)

    @property
    def active_flows(self) -> int:
        return len(self.heap)


class PullSlots:
    """One decoding engine's pulls: at most `slots` move at once (the connector's pull
    threads, KVTransferSettings.concurrent_pulls); the others wait, and a freed slot
    takes the smallest (`smallest_first`, ties in arrival order) or the oldest.
    Their wait is not on the link: it is neither bandwidth shared nor a latency draw."""

    __slots__ = ("loop", "free", "waiting", "smallest_first", "tickets")

    def __init__(self, loop: Loop, slots: int, order: PullOrder = PullOrder.smallest_first):
        self.loop = loop
        self.free = slots
        self.smallest_first = order is PullOrder.smallest_first
        self.waiting: list[tuple[int, int, tuple[Link, int, Callable[[Any], None], Any]]] = []
        self.tickets = count()

    def pull(self, link: Link, nbytes: int, done: Callable[[Any], None], arg: Any, after: float = 0.0) -> None:
        """Pull `nbytes` over `link`, asked for `after` seconds from now (the engine's own
        processing of its request first); call `done(arg)` when the last byte arrived
        (at once then for 0 bytes: an empty pull takes no thread's time worth modelling)."""
        loop = self.loop
        if nbytes <= 0:
            loop.at(loop.now + after, done, arg)
        elif after > 0:
            loop.at(loop.now + after, self._ask, (link, nbytes, done, arg))
        else:
            self._ask((link, nbytes, done, arg))

    def _ask(self, pull: tuple[Link, int, Callable[[Any], None], Any]) -> None:
        if self.free:
            self.free -= 1
            pull[0].send(pull[1], self._ended, pull)
        else:
            heapq.heappush(self.waiting, (pull[1] if self.smallest_first else 0, next(self.tickets), pull))

    def _ended(self, pull: tuple[Link, int, Callable[[Any], None], Any]) -> None:
        if self.waiting:
            nxt = heapq.heappop(self.waiting)[2]
            nxt[0].send(nxt[1], self._ended, nxt)
        else:
            self.free += 1
        pull[2](pull[3])
