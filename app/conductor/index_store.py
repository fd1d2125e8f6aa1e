"""The conductor's prefix index, saved in Ray's GCS so that a new conductor starts from it.

A conductor that restarts (a crash, a redeploy of its code) finds the engines'
caches as the last one left them. With an empty index it would take every
returning conversation's context for gone and route the next turn as if all of
it had to cross the WAN: P-RLD-MD, for every live conversation at once, loading
the relay and queueing transfers that never happen. So the conductor saves each
replica's confirmed blocks every SAVE_INTERVAL_S when they changed, and restores
them as it starts. What a replica evicted in between is corrected by the
engines' own hit reports, as always (app/conductor/prefix_index.py).

The GCS's key-value store (where Serve keeps its own checkpoints) lives as long
as the Ray cluster, and with GCS fault tolerance (KubeRay's Redis) across a head
node's restart too. Its calls block: the conductor makes them from a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from app.conductor.prefix_index import PrefixIndex
from app.ray_private import kv_delete, kv_get, kv_keys, kv_put

logger = logging.getLogger(__name__)

SAVE_INTERVAL_S = 5.0
"""How often the conductor saves the replicas whose blocks changed: what a restart can lose."""
NAMESPACE = "pdd-serve"


class ReplicaSnapshot(msgspec.Struct, array_like=True):
    """One replica's confirmed blocks."""

    block_size: int
    capacity_blocks: int
    held: list[int]
    """Block keys (app.conductor.prefix_index.block_keys), least recently used first."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ReplicaSnapshot)


class IndexStore:
    """Saved replica snapshots of one Serve application, one key per replica."""

    def __init__(self, app_name: str):
        self.prefix = f"prefix-index/{app_name}/"

    def load(self, block_size: int) -> dict[str, ReplicaSnapshot]:
        """Every saved replica's snapshot of this block size (another block size's blocks
        are not this model's: a config changed in between)."""
        snapshots = {}
        for key in kv_keys(self.prefix, NAMESPACE):
            replica_id = key.decode().removeprefix(self.prefix)
            data = kv_get(key, NAMESPACE)
            try:
                snapshot = _decoder.decode(data) if data is not None else None
            except msgspec.DecodeError:
                logger.warning("prefix index of replica %s: unreadable snapshot, ignored", replica_id)
                continue
            if snapshot is not None and snapshot.block_size == block_size:
                snapshots[replica_id] = snapshot
        return snapshots

    def save(self, replica_id: str, snapshot: ReplicaSnapshot) -> None:
        kv_put(self.prefix + replica_id, _encoder.encode(snapshot), NAMESPACE)

    def delete(self, replica_id: str) -> None:
        kv_delete(self.prefix + replica_id, NAMESPACE)

    def clear(self) -> None:
        """Forget every replica (the next conductor starts from an empty index)."""
        kv_delete(self.prefix, NAMESPACE, by_prefix=True)


class IndexKeeper:
    """Keeps a conductor's prefix index saved in an IndexStore, and restores it."""

    def __init__(self, store: IndexStore | None, live_replica_ids: Callable[[], set[str] | None]):
        self.store = store
        """None without a store, or once forgotten: nothing is restored or saved."""
        self._live_replica_ids = live_replica_ids
        self._saved_changes: dict[str, int] = {}
        """Replica id -> its index entry's change count when last saved."""
        self.saved_at: float | None = None
        self._saver: asyncio.Task | None = None
        self._saving = asyncio.Lock()
        """Held by each save round: `forget` and `replace` wait for the one in flight."""

    def restore(self, index: PrefixIndex) -> None:
        """Fill `index` with what the last conductor saved; leave it empty if that cannot be read."""
        if self.store is None:
            return
        try:
            saved = self.store.load(index.block_size)
        except Exception:  # noqa: BLE001 - the GCS unreachable: routing still works, blind for a turn
            logger.warning("could not read the saved prefix index; starting from an empty one", exc_info=True)
            return
        for replica_id, snapshot in saved.items():
            index.restore(replica_id, snapshot.capacity_blocks, snapshot.held)
            self._saved_changes[replica_id] = index.changes(replica_id)
        if saved:
            logger.info("prefix index restored: %s", {rid: len(s.held) for rid, s in saved.items()})

    def keep_saved(self, current: Callable[[], PrefixIndex]) -> None:
        """Save `current()` every SAVE_INTERVAL_S from now on (once started, further calls do nothing)."""
        if self._saver is None and self.store is not None:
            self._saver = asyncio.create_task(self._save_forever(current))

    async def _save_forever(self, current: Callable[[], PrefixIndex]) -> None:
        while True:
            await asyncio.sleep(SAVE_INTERVAL_S)
            try:
                await self.save(current())
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.warning("saving the prefix index failed", exc_info=True)

    async def save(self, index: PrefixIndex) -> None:
        """Save each replica whose confirmed blocks changed since its last save, and forget
        the replicas Serve no longer routes to (dead, scaled away), in the index and the store."""
        async with self._saving:
            if self.store is None:
                return
            live = self._live_replica_ids()
            if live is not None:
                index.forget_all_but(live)
            known = set(index.known_replicas())
            for replica_id in [rid for rid in self._saved_changes if rid not in known]:
                await asyncio.to_thread(self.store.delete, replica_id)
                self._saved_changes.pop(replica_id, None)
            for replica_id in known:
                changes = index.changes(replica_id)
                if self._saved_changes.get(replica_id) != changes:
                    capacity, held = index.snapshot(replica_id)
                    await asyncio.to_thread(self.store.save, replica_id, ReplicaSnapshot(index.block_size, capacity, held))
                    self._saved_changes[replica_id] = changes
            self.saved_at = time.time()

    async def replace(self, swap: Callable[[], None]) -> None:
        """Run `swap` (the conductor's index replaced by an empty one) between saves, and
        clear the store: it is left holding the new, empty index."""
        async with self._saving:
            swap()
            if self.store is not None:
                await asyncio.to_thread(self.store.clear)
                self._saved_changes.clear()

    async def forget(self) -> None:
        """Clear the store and save no more: the next conductor starts from an empty index
        (fault injection: a conductor lost with the GCS's store)."""
        store, self.store = self.store, None
        if self._saver is not None:
            self._saver.cancel()
        async with self._saving:  # a save already in the GCS's queue lands before the clear
            if store is not None:
                await asyncio.to_thread(store.clear)
