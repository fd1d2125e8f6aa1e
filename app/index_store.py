"""The conductor's prefix index, saved in Ray's GCS so that a new conductor starts from it.

A conductor that restarts (a crash, a redeploy of its code) finds the engines'
caches as the last one left them. With an empty index it would take every
returning conversation's context for gone and route the next turn as if all of
it had to cross the WAN: P-RLD-MD, for every live conversation at once, loading
the relay and queueing transfers that never happen. So the conductor saves each
replica's confirmed blocks every SAVE_INTERVAL_S when they changed, and restores
them as it starts. What a replica evicted in between is corrected by the
engines' own hit reports, as always (app/prefix_index.py).

The GCS's key-value store (where Serve keeps its own checkpoints) lives as long
as the Ray cluster, and with GCS fault tolerance (KubeRay's Redis) across a head
node's restart too. Its calls block: the conductor makes them from a thread.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)

SAVE_INTERVAL_S = 5.0
"""How often the conductor saves the replicas whose blocks changed: what a restart can lose."""
NAMESPACE = "pdd-serve"


class ReplicaSnapshot(msgspec.Struct, array_like=True):
    """One replica's confirmed blocks."""

    block_size: int
    capacity_blocks: int
    held: list[int]
    """Block keys (app.prefix_index.block_keys), least recently used first."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ReplicaSnapshot)


class IndexStore:
    """Saved replica snapshots of one Serve application, one key per replica."""

    def __init__(self, app_name: str):
        self.prefix = f"prefix-index/{app_name}/"

    def load(self, block_size: int) -> dict[str, ReplicaSnapshot]:
        """Every saved replica's snapshot of this block size (another block size's blocks
        are not this model's: a config changed in between)."""
        from ray.experimental import internal_kv

        snapshots = {}
        for key in internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            replica_id = key.decode().removeprefix(self.prefix)
            data = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            try:
                snapshot = _decoder.decode(data) if data is not None else None
            except msgspec.DecodeError:
                logger.warning("prefix index of replica %s: unreadable snapshot, ignored", replica_id)
                continue
            if snapshot is not None and snapshot.block_size == block_size:
                snapshots[replica_id] = snapshot
        return snapshots

    def save(self, replica_id: str, snapshot: ReplicaSnapshot) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.prefix + replica_id, _encoder.encode(snapshot), overwrite=True, namespace=NAMESPACE)

    def delete(self, replica_id: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix + replica_id, namespace=NAMESPACE)

    def clear(self) -> None:
        """Forget every replica (the next conductor starts from an empty index)."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)
