"""app/conductor/index_store.py on a real (local) Ray cluster's GCS."""

import asyncio
import time

import pytest
import ray

from app.conductor.conductor import Conductor
from app.conductor.index_store import IndexKeeper, IndexStore, ReplicaSnapshot
from tests.unit.test_conductor import ScriptedEngines, conductor, tokenizer  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def gcs():
    if ray.is_initialized():  # the integration tests' cluster, in a whole-suite run
        yield
        return
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_each_apps_replicas_are_saved_loaded_and_forgotten(gcs):
    store, other_app = IndexStore("unit-store"), IndexStore("unit-store-2")
    store.save("md-0", ReplicaSnapshot(32, 1000, [3, 1, 2]))
    store.save("md-1", ReplicaSnapshot(32, 500, [7]))
    store.save("md-1", ReplicaSnapshot(32, 500, [7, 8]))  # a later save replaces the earlier
    store.save("p-0", ReplicaSnapshot(16, 1000, [9]))  # another block size: another model's blocks
    other_app.save("md-0", ReplicaSnapshot(32, 1000, [4]))
    assert store.load(32) == {"md-0": ReplicaSnapshot(32, 1000, [3, 1, 2]), "md-1": ReplicaSnapshot(32, 500, [7, 8])}
    store.delete("md-0")
    assert list(store.load(32)) == ["md-1"]
    store.clear()
    assert store.load(32) == {} and store.load(16) == {}
    assert other_app.load(32) == {"md-0": ReplicaSnapshot(32, 1000, [4])}


async def test_a_conductor_saves_what_changed_and_the_next_one_starts_from_it(gcs, conductor):  # noqa: F811 - the fixture
    """md-0 is the scripted engines' one live replica; md-gone is no longer routed to."""
    store = IndexStore("unit-conductor")
    conductor.placement.keeper = IndexKeeper(store, conductor.engines.live_replica_ids)
    keys = conductor.placement.index.keys(list(range(10, 10 + 96)))
    conductor.placement.index.record("md-0", keys, 1000)
    conductor.placement.index.record("md-gone", keys, 1000)
    await conductor.save_index()
    assert list(store.load(conductor.placement.index.block_size)) == ["md-0"] and conductor.placement.index.known_replicas() == ["md-0"]
    after = Conductor(conductor.config, conductor.engines, links=None, tokenizer=conductor.tokenizer, index_store=store)
    assert after.placement.index.estimate("md-0", keys) == 96
    after.placement.index.observe("md-0", keys, actual_cached_tokens=32)  # an eviction learned
    await after.save_index()
    assert store.load(after.placement.index.block_size)["md-0"].held == keys[:1]
    await after.reset_prefix_caches()
    assert store.load(after.placement.index.block_size) == {}


async def test_a_forgotten_index_stays_forgotten_even_with_a_save_in_flight(gcs, conductor):  # noqa: F811 - the fixture
    store = IndexStore("unit-forget")
    slow_save = store.save
    store.save = lambda *args: (time.sleep(0.3), slow_save(*args))
    conductor.placement.keeper = IndexKeeper(store, conductor.engines.live_replica_ids)
    conductor.placement.index.record("md-0", conductor.placement.index.keys(list(range(64))), 1000)
    saving = asyncio.create_task(conductor.save_index())
    await asyncio.sleep(0.05)  # the save is in its thread
    await conductor.forget_saved_index()
    await saving
    assert store.load(conductor.placement.index.block_size) == {}
    conductor.placement.index.record("md-0", conductor.placement.index.keys(list(range(96))), 1000)
    await conductor.save_index()
    assert store.load(conductor.placement.index.block_size) == {}, "a conductor that forgot saves no more"
