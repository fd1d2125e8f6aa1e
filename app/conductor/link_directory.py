"""The link emulators as the conductor's routing sees them: relay addresses and link health."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.conductor.generation import EngineError
from app.engine.kv.link import direction_name

logger = logging.getLogger(__name__)


class LinkDirectory:
    """The link emulators as routing sees them (one deployment per receiving
    datacenter): relay addresses and link health. A background poll refreshes
    them every HEALTH_TTL_S (a replaced replica has new ports), so requests
    read the last view and never wait on the emulators' answers; only the
    first call waits for a view. A datacenter whose emulator does not answer
    counts as cut off."""

    HEALTH_TTL_S = 1.0
    CALL_TIMEOUT_S = 2.0
    FAILURES_TO_CUT_OFF = 2
    """Refreshes in a row a datacenter's emulator must miss before it counts as cut off:
    one slow answer on a busy machine is not a datacenter outage."""

    def __init__(self, handles: dict[str, Any]):
        self._handles = handles
        self._known: dict[str, tuple[dict[str, tuple[str, int]], dict[str, Any]]] = {}
        self._misses: dict[str, int] = {}
        self._last_error: dict[str, Exception] = {}
        self._relays: dict[str, tuple[str, int]] = {}
        self._counters: dict[str, Any] = {}
        self._unreachable: set[str] = set()
        self._first: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None

    async def _view(self) -> None:
        """The first call (on each event loop) starts the poll and, with any calls
        beside it, waits for the first answers; later calls read the view."""
        if self._first is None or self._poller is None or self._poller.done():
            self._first = asyncio.create_task(self.refresh())
            self._poller = asyncio.create_task(self._poll())
        if not self._first.done():
            await asyncio.shield(self._first)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.HEALTH_TTL_S)
            try:
                await self.refresh()
            except Exception:  # the next round tries again; requests keep the last view
                logger.exception("refreshing the link emulators' view failed")

    async def refresh(self) -> None:
        """Ask every emulator for its relays and counters once."""
        results = await asyncio.gather(*(self._ask(dc, h) for dc, h in self._handles.items()))
        for dc, result in zip(self._handles, results):
            if result is None:
                self._misses[dc] = self._misses.get(dc, 0) + 1
            else:
                self._misses[dc] = 0
                self._known[dc] = result
        unreachable = {dc for dc in self._handles if self._misses.get(dc, 0) >= self.FAILURES_TO_CUT_OFF or dc not in self._known}
        for dc in sorted(unreachable - self._unreachable):
            logger.warning("%s cut off: its link emulator missed %d polls in a row (last: %r)", dc, self._misses.get(dc, 0), self._last_error.get(dc))
        for dc in sorted(self._unreachable - unreachable):
            logger.info("%s reachable again", dc)
        self._unreachable = unreachable
        self._relays, self._counters = {}, {}
        for dc, (relays, counters) in self._known.items():
            if dc not in self._unreachable:
                self._relays.update(relays)
                self._counters.update(counters)

    async def _ask(self, dc: str, handle: Any):
        try:
            return await asyncio.wait_for(asyncio.gather(handle.describe.remote(), handle.counters.remote()), self.CALL_TIMEOUT_S)
        except Exception as exc:  # its datacenter is down, or its deployment gone (DeploymentUnavailableError)
            self._last_error[dc] = exc
            return None

    async def counters(self) -> dict[str, Any]:
        await self._view()
        return self._counters

    async def down_reason(self, src_dc: str, dst_dc: str) -> str | None:
        """Why KV cannot cross from src_dc to dst_dc now (journeys show it), or None when it can."""
        await self._view()
        if dst_dc in self._unreachable:
            if dst_dc not in self._known:
                return f"{dst_dc} unreachable: its link emulator has not answered yet"
            last = type(self._last_error.get(dst_dc)).__name__
            return f"{dst_dc} unreachable: its link emulator missed {self._misses[dst_dc]} polls in a row ({last})"
        name = direction_name(src_dc, dst_dc)
        link = self._counters.get(name)
        return f"{name} cut" if link is not None and link["is_cut"] else None

    async def relay(self, src_dc: str, dst_dc: str) -> tuple[str, tuple[str, int]]:
        await self._view()
        name = direction_name(src_dc, dst_dc)
        if name not in self._relays:
            raise EngineError(f"no link emulator for {name} (reachable: {', '.join(sorted(self._relays)) or 'none'})")
        return name, self._relays[name]
