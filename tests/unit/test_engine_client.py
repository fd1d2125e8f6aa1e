"""The conductor's view of engine replicas: a role with none alive answers "none", at once;
a replica Serve lists that cannot describe itself costs routing one bounded wait, not one per request."""

from __future__ import annotations

import asyncio
import time

import pytest

import app.conductor.engine_client
from app.conductor import replica_router
from app.conductor.engine_client import EngineClient
from app.config import RoleName
from app.engine.deployments import DEPLOYMENT_NAMES
from app.engine.replica import ReplicaInfo

MAIN = DEPLOYMENT_NAMES[RoleName.main_decode]


def _info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, RoleName.main_decode.value, "127.0.0.1", "n", "dc-b", 100, 16, 7000, 1024)


class _Describe:
    """A stand-in for a deployment handle's `describe` method: Serve holds a call
    while the deployment has no replica, so with no `alive` replicas it never answers."""

    def __init__(self, alive: list[str]):
        self.alive = alive
        self.calls = 0

    def remote(self, target_replica: str | None = None):
        self.calls += 1

        async def answer() -> ReplicaInfo:
            if not self.alive or (target_replica is not None and target_replica not in self.alive):
                await asyncio.Event().wait()
            return _info(target_replica or self.alive[0])

        return answer()


class _Handle:
    def __init__(self, alive: list[str]):
        self.describe = _Describe(alive)


@pytest.fixture
def router_state(monkeypatch):
    monkeypatch.setattr(replica_router, "_live", {})
    monkeypatch.setattr(app.conductor.engine_client, "DESCRIBE_TIMEOUT_S", 0.2)
    return replica_router._live


def _replicas(client: EngineClient) -> tuple[list[ReplicaInfo], float]:
    t0 = time.monotonic()
    found = asyncio.run(client.replicas(RoleName.main_decode))
    return found, time.monotonic() - t0


def test_a_role_whose_replicas_all_died_has_none_without_waiting_for_them(router_state):
    handle = _Handle(alive=[])
    router_state[MAIN] = frozenset()  # the router saw the last replica go
    found, _ = _replicas(EngineClient({RoleName.main_decode: handle}))
    assert found == [] and handle.describe.calls == 0


def test_an_unanswered_description_bounds_routing_instead_of_hanging_it(router_state):
    handle = _Handle(alive=[])  # the router is not built yet and no replica is up
    found, elapsed = _replicas(EngineClient({RoleName.main_decode: handle}))
    assert found == [] and handle.describe.calls == 1
    assert elapsed < 5  # bounded by DESCRIBE_TIMEOUT_S, not by the replica's return


def test_live_replicas_are_described_once(router_state):
    handle = _Handle(alive=["md-1", "md-2"])
    router_state[MAIN] = frozenset({"md-1", "md-2"})
    client = EngineClient({RoleName.main_decode: handle})
    assert [i.replica_id for i in _replicas(client)[0]] == ["md-1", "md-2"]
    assert [i.replica_id for i in _replicas(client)[0]] == ["md-1", "md-2"]
    assert handle.describe.calls == 2
    client.suspect("md-1")
    assert [i.replica_id for i in _replicas(client)[0]] == ["md-2"]


def test_concurrent_requests_share_one_description_and_a_dead_replica_is_not_waited_for_again(router_state):
    handle = _Handle(alive=[])  # Serve still lists a replacement that died before it answered
    router_state[MAIN] = frozenset({"md-2"})
    client = EngineClient({RoleName.main_decode: handle})

    async def burst() -> list[list[ReplicaInfo]]:
        return await asyncio.gather(*(client.replicas(RoleName.main_decode) for _ in range(5)))

    assert asyncio.run(burst()) == [[]] * 5
    assert handle.describe.calls == 1
    found, elapsed = _replicas(client)  # left out of routing now: no second wait
    assert found == [] and handle.describe.calls == 1 and elapsed < 0.1


def test_a_new_replica_is_described_in_the_background_while_another_serves(router_state):
    handle = _Handle(alive=["md-1", "md-2"])
    router_state[MAIN] = frozenset({"md-1"})
    client = EngineClient({RoleName.main_decode: handle})

    async def scale_up() -> tuple[list[str], list[str]]:
        await client.replicas(RoleName.main_decode)
        router_state[MAIN] = frozenset({"md-1", "md-2"})
        at_once = [i.replica_id for i in await client.replicas(RoleName.main_decode)]
        await asyncio.sleep(0.05)
        return at_once, [i.replica_id for i in await client.replicas(RoleName.main_decode)]

    assert asyncio.run(scale_up()) == (["md-1"], ["md-1", "md-2"])


def test_a_role_the_request_can_do_without_does_not_wait_for_a_description(router_state):
    handle = _Handle(alive=[])
    router_state[MAIN] = frozenset({"md-2"})
    t0 = time.monotonic()
    found = asyncio.run(EngineClient({RoleName.main_decode: handle}).replicas(RoleName.main_decode, wait=False))
    assert found == [] and time.monotonic() - t0 < 0.1 and handle.describe.calls == 1


@pytest.mark.parametrize("alive", [["md-1"], []])
def test_a_fresh_conductor_looks_at_a_role_it_can_do_without_briefly(router_state, monkeypatch, alive):
    monkeypatch.setattr(app.conductor.engine_client, "DESCRIBE_TIMEOUT_S", 5.0)
    monkeypatch.setattr(app.conductor.engine_client, "FIRST_LOOK_WAIT_S", 0.1)
    handle = _Handle(alive=alive)  # the router is not built yet
    client = EngineClient({RoleName.main_decode: handle})

    async def first_requests() -> tuple[list[list[ReplicaInfo]], float]:
        t0 = time.monotonic()
        found = await asyncio.gather(*(client.replicas(RoleName.main_decode, wait=False) for _ in range(3)))
        elapsed = time.monotonic() - t0
        for task in list(client._first_look.values()):
            task.cancel()
        return found, elapsed

    found, elapsed = asyncio.run(first_requests())
    assert [[i.replica_id for i in f] for f in found] == [alive] * 3  # a live relay is found at once
    assert elapsed < 1 and handle.describe.calls == 1  # a dead one costs the requests a short look, together


class _Reset:
    """A stand-in for `reset_prefix_cache`: vLLM refuses while blocks are in use,
    here for a replica's first `busy_calls` calls."""

    def __init__(self, busy_calls: dict[str, int]):
        self.busy_calls = busy_calls
        self.calls: list[str] = []

    def remote(self, target_replica: str):
        self.calls.append(target_replica)

        async def answer() -> bool:
            return self.calls.count(target_replica) > self.busy_calls.get(target_replica, 0)

        return answer()


def test_a_replica_whose_blocks_are_in_use_is_asked_again_until_its_cache_empties(router_state, monkeypatch):
    monkeypatch.setattr(app.conductor.engine_client, "RESET_RETRY_S", 0.01)
    handle = _Handle(alive=["md-1", "md-2"])
    handle.reset_prefix_cache = _Reset({"md-2": 3})
    router_state[MAIN] = frozenset({"md-1", "md-2"})
    asyncio.run(EngineClient({RoleName.main_decode: handle}).reset_prefix_caches())
    assert handle.reset_prefix_cache.calls.count("md-1") == 1 and handle.reset_prefix_cache.calls.count("md-2") == 4


def test_a_cache_that_never_empties_is_an_error_naming_the_replica(router_state, monkeypatch):
    monkeypatch.setattr(app.conductor.engine_client, "RESET_RETRY_S", 0.01)
    handle = _Handle(alive=["md-1", "md-2"])
    handle.reset_prefix_cache = _Reset({"md-2": 10**9})
    router_state[MAIN] = frozenset({"md-1", "md-2"})
    with pytest.raises(TimeoutError, match=r"\['md-2'\] still had blocks in use"):
        asyncio.run(EngineClient({RoleName.main_decode: handle}).reset_prefix_caches(timeout_s=0.1))


def test_a_fresh_conductor_empties_the_caches_of_replicas_it_has_not_described_yet(router_state, monkeypatch):
    """A fresh conductor's first look describes one replica; the reset still reaches every one
    Serve routes to (a cache left warm would serve the next prompt from its prefix)."""
    handle = _Handle(alive=["md-1"])  # md-2 is live but does not describe itself (yet)
    handle.reset_prefix_cache = _Reset({})
    router_state[MAIN] = frozenset({"md-1", "md-2"})
    asyncio.run(EngineClient({RoleName.main_decode: handle}).reset_prefix_caches())
    assert sorted(handle.reset_prefix_cache.calls) == ["md-1", "md-2"]
