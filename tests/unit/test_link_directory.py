"""The conductor's view of the link emulators: one slow answer is not an outage,
and no request waits for the emulators once a view exists."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.serve.exceptions import DeploymentUnavailableError

from app.conductor.link_directory import LinkDirectory


class _Method:
    def __init__(self, owner: _Emulator, value):
        self.owner, self.value = owner, value

    def remote(self):
        async def answer():
            if self.owner.down:
                raise self.owner.failure
            await self.owner.answering.wait()
            return self.value

        return answer()


class _Emulator:
    """Answers like a Links-<dc> deployment handle, fails (`down`: with `failure`) like a dead one, or hangs (`answering` cleared)."""

    def __init__(self, dc: str):
        self.down = False
        self.failure: Exception = RuntimeError("actor unreachable")
        self.answering = asyncio.Event()
        self.answering.set()
        self.describe = _Method(self, {f"dc-a->{dc}": ("10.0.0.2", 7000)})
        self.counters = _Method(self, {f"dc-a->{dc}": {"is_cut": False, "bytes_down": 1}})


def _directory(b: _Emulator, ttl_s: float) -> LinkDirectory:
    links = LinkDirectory({"dc-b": b})
    links.HEALTH_TTL_S = ttl_s
    return links


@pytest.mark.parametrize("failure", [RuntimeError("actor unreachable"), DeploymentUnavailableError("Links-dc-b")])
def test_a_datacenter_is_cut_off_only_after_consecutive_misses(failure, caplog):
    b = _Emulator("dc-b")
    b.failure = failure
    links = _directory(b, ttl_s=3600)  # refreshes only where the test asks
    caplog.set_level(logging.INFO, logger="app.conductor.link_directory")

    def warnings() -> list[str]:
        # asyncio may log here too (another test's task collected mid-run)
        return [r.getMessage() for r in caplog.records if r.name == "app.conductor.link_directory"]

    async def scenario() -> None:
        assert await links.down_reason("dc-a", "dc-b") is None
        b.down = True
        await links.refresh()
        assert (await links.counters())["dc-a->dc-b"]["bytes_down"] == 1, "one missed refresh keeps the last known state"
        assert await links.down_reason("dc-a", "dc-b") is None
        assert not warnings()
        await links.refresh()
        assert await links.down_reason("dc-a", "dc-b") == f"dc-b unreachable: its link emulator missed 2 polls in a row ({type(failure).__name__})", (
            "the second in a row cuts it off"
        )
        assert await links.counters() == {}
        await links.refresh()
        assert warnings() == [f"dc-b cut off: its link emulator missed 2 polls in a row (last: {failure!r})"], "one warning per outage"
        b.down = False
        await links.refresh()
        assert await links.down_reason("dc-a", "dc-b") is None
        assert warnings()[-1] == "dc-b reachable again"

    asyncio.run(scenario())


def test_never_seen_is_unreachable():
    b = _Emulator("dc-b")
    b.down = True
    links = _directory(b, ttl_s=3600)
    assert asyncio.run(links.down_reason("dc-a", "dc-b")) == "dc-b unreachable: its link emulator has not answered yet"


def test_requests_read_the_last_view_while_the_emulators_are_slow():
    """The poll, not the request, waits for the emulators: before, a request whose
    view was older than HEALTH_TTL_S waited for their answers on its way to prefill."""
    b = _Emulator("dc-b")
    links = _directory(b, ttl_s=0.01)

    async def scenario() -> None:
        assert await links.down_reason("dc-a", "dc-b") is None
        b.answering.clear()  # every later question hangs (until the call timeout)
        await asyncio.sleep(0.05)  # the view is stale and a refresh is under way
        assert await asyncio.wait_for(links.down_reason("dc-a", "dc-b"), timeout=1.0) is None
        name, relay = await asyncio.wait_for(links.relay("dc-a", "dc-b"), timeout=1.0)
        assert (name, relay) == ("dc-a->dc-b", ("10.0.0.2", 7000))
        b.answering.set()

    asyncio.run(scenario())


def test_the_poll_notices_an_outage_and_its_end_without_requests():
    b = _Emulator("dc-b")
    links = _directory(b, ttl_s=0.01)

    async def until(up: bool) -> None:
        while (await links.down_reason("dc-a", "dc-b") is None) != up:
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        assert await links.down_reason("dc-a", "dc-b") is None
        b.down = True
        await asyncio.wait_for(until(False), timeout=5)
        b.down = False
        await asyncio.wait_for(until(True), timeout=5)

    asyncio.run(scenario())


def test_a_new_event_loop_gets_its_own_poll():
    b = _Emulator("dc-b")
    links = _directory(b, ttl_s=3600)
    assert asyncio.run(links.down_reason("dc-a", "dc-b")) is None
    b.down = True
    links.FAILURES_TO_CUT_OFF = 1
    assert asyncio.run(links.down_reason("dc-a", "dc-b")) is not None, "the first call on a new loop waits for a fresh view"


def test_a_cut_link_is_down_while_its_datacenter_answers():
    b = _Emulator("dc-b")
    b.counters.value = {"dc-a->dc-b": {"is_cut": True, "bytes_down": 1}}
    links = _directory(b, ttl_s=3600)
    assert asyncio.run(links.down_reason("dc-a", "dc-b")) == "dc-a->dc-b cut"
