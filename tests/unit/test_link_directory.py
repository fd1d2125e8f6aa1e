"""The conductor's view of the link emulators: one slow answer is not an outage."""

from __future__ import annotations

import asyncio

from app.conductor import LinkDirectory


class _Method:
    def __init__(self, owner: "_Emulator", value):
        self.owner, self.value = owner, value

    def remote(self):
        async def answer():
            if self.owner.down:
                raise RuntimeError("actor unreachable")
            return self.value

        return answer()


class _Emulator:
    """Answers like a Links-<dc> deployment handle, or fails like a dead one."""

    def __init__(self, dc: str):
        self.down = False
        self.describe = _Method(self, {f"dc-a->{dc}": ("10.0.0.2", 7000)})
        self.counters = _Method(self, {f"dc-a->{dc}": {"is_cut": False, "bytes_down": 1}})


def test_a_datacenter_is_cut_off_only_after_consecutive_misses():
    b = _Emulator("dc-b")
    links = LinkDirectory({"dc-b": b})
    links.HEALTH_TTL_S = 0.0

    async def up() -> bool:
        return await links.is_up("dc-a", "dc-b")

    assert asyncio.run(up())
    b.down = True
    assert asyncio.run(links.counters())["dc-a->dc-b"]["bytes_down"] == 1, "one missed refresh keeps the last known state"
    assert not asyncio.run(up()), "the second in a row cuts it off"
    assert asyncio.run(links.counters()) == {}
    b.down = False
    assert asyncio.run(up())


def test_never_seen_is_unreachable():
    b = _Emulator("dc-b")
    b.down = True
    links = LinkDirectory({"dc-b": b})
    assert not asyncio.run(links.is_up("dc-a", "dc-b"))
