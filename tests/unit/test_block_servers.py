"""A relay's view of the registered block servers: unknown addresses read the registry,
at most once per refresh interval however many arrive."""

from app.engine.kv import block_servers
from app.engine.kv.block_servers import BlockServerDirectory


async def test_an_unknown_address_rereads_the_registry_at_most_once_per_interval(monkeypatch):
    registry = {("10.0.0.1", 5000)}
    reads = []

    def registered():
        reads.append(1)
        return set(registry)

    monkeypatch.setattr(block_servers, "registered", registered)
    directory = BlockServerDirectory(refresh_s=60)
    assert await directory.allowed(("10.0.0.1", 5000))
    assert not await directory.allowed(("10.0.0.1", 22))
    registry.add(("10.0.0.2", 5000))
    assert not await directory.allowed(("10.0.0.2", 5000))  # registered since, but within the interval
    assert len(reads) == 1
    directory = BlockServerDirectory(refresh_s=0)
    assert not await directory.allowed(("10.0.0.1", 22)) and await directory.allowed(("10.0.0.2", 5000))
    assert len(reads) == 2  # the second was known from the first's read
    assert not await directory.allowed(("10.0.0.1", 22))
    assert len(reads) == 3
