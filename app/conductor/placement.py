"""Placement: which replica of a role takes a request, and what the prefix index learns from it.

The index (prefix_index.py) estimates each replica's cached prefix from what was routed
where; routing picks the replica expected to hold the longest prefix unless its batch is
full, and the engines' real hits correct the estimate. MD warm-ups in flight are tracked
so that a conversation's next turn waits for their blocks instead of pulling them again.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from app.conductor.engine_client import NoReplicaError
from app.conductor.index_store import IndexKeeper, IndexStore
from app.conductor.journal import Journey
from app.conductor.prefix_index import PrefixIndex
from app.config import PDDConfig, RoleName
from app.engine.replica import ReplicaInfo
from app.policy import affinity_room


class ReplicaView(Protocol):
    """What placement reads of the engine client: live replicas, their load, and their ids."""

    async def replicas(self, role: RoleName) -> list[ReplicaInfo]: ...

    def load(self, replica_id: str) -> int: ...

    def live_replica_ids(self) -> set[str] | None: ...


class Placement:
    def __init__(self, config: PDDConfig, engines: ReplicaView, index_store: IndexStore | None = None):
        self._config = config
        self._engines = engines
        self.index = PrefixIndex(config.model.block_size)
        self.keeper = IndexKeeper(index_store, engines.live_replica_ids)
        """Saves the index for the next conductor (without a store: nothing is saved)."""
        self.keeper.restore(self.index)
        self._warms: dict[str, dict[int, asyncio.Task]] = {}
        """MD warm-ups in flight: replica id -> last prompt block key -> task."""

    def keys(self, tokens: list[int]) -> list[int]:
        return self.index.keys(tokens)

    async def route(self, role: RoleName, keys: list[int], journey: Journey) -> tuple[ReplicaInfo, int]:
        """The replica of `role` expected to hold the longest prefix (unless its batch is full)."""
        infos = {i.replica_id: i for i in await self._engines.replicas(role)}
        if not infos:
            raise NoReplicaError(f"no live {role.value} replica")
        room = affinity_room(self._config.roles.of(role).engine)
        choice = self.index.choose({rid: i.num_kv_blocks for rid, i in infos.items()}, keys, self._engines.load, room)
        journey.replicas[role.value] = choice.replica_id
        replica = infos[choice.replica_id]
        # the next turn may arrive before this one ends: it should come here too
        self.index.route(replica.replica_id, keys, replica.num_kv_blocks)
        return replica, choice.cached_tokens

    def unroute(self, replica: ReplicaInfo, keys: list[int]) -> None:
        """The request will not leave its prompt on this replica after all."""
        self.index.unroute(replica.replica_id, keys)

    def remember(self, replica: ReplicaInfo, tokens: list[int], actual_hit: int | None = None, prompt_keys: list[int] | None = None) -> None:
        """After a request: correct the estimate with the engine's real hit, then
        record what the replica now holds."""
        keys = self.index.keys(tokens)
        if actual_hit is not None:
            self.index.observe(replica.replica_id, prompt_keys if prompt_keys is not None else keys, actual_hit)
        self.index.record(replica.replica_id, keys, replica.num_kv_blocks)

    def track_warm(self, replica: ReplicaInfo, keys: list[int], task: asyncio.Task) -> None:
        """An MD warm-up is pulling these blocks: a next turn of the conversation waits
        for it rather than pulling the same blocks again."""
        if not keys:
            return
        warms = self._warms.setdefault(replica.replica_id, {})
        warms[keys[-1]] = task
        task.add_done_callback(lambda _t: warms.pop(keys[-1], None) if warms.get(keys[-1]) is _t else None)

    def pending_warm(self, replica: ReplicaInfo, keys: list[int]) -> tuple[asyncio.Task | None, int]:
        """The warm-up in flight on `replica` covering the longest prefix of `keys`,
        and how many of their blocks it covers."""
        warms = self._warms.get(replica.replica_id)
        if warms:
            for i in range(len(keys) - 1, -1, -1):
                task = warms.get(keys[i])
                if task is not None and not task.done():
                    return task, i + 1
        return None, 0

    async def await_warm(self, task: asyncio.Task | None) -> None:
        """Wait (bounded) for another request's warm-up; its failure is its own."""
        if task is not None:
            await asyncio.wait({task}, timeout=self._config.kv.transfer_timeout_s)

    def warming(self, replica_id: str) -> int:
        """Warm-ups in flight on a replica."""
        return len(self._warms.get(replica_id, {}))

    async def forget_all(self) -> None:
        """An empty index, saved as such (the engines' caches were emptied)."""

        def empty_index() -> None:
            self.index = PrefixIndex(self._config.model.block_size)

        await self.keeper.replace(empty_index)
