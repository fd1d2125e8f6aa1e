"""Which replica holds which prompt prefix: hit estimates and affinity.

An index of what was routed (recorded when a request is routed, completed with
its output when it ends), not vLLM's KV cache events. Why: the estimate is
needed before routing, in the conductor, and what was routed is exact there at
no cost, while KV events would need a subscriber per engine and would still
lag the routing decisions they must inform. Evictions, the one thing routing
cannot see, are learned from the engines' own reports: every response says how
many prompt tokens the engine actually found cached, and a shortfall truncates
the index (`observe`). Capacity is bounded per replica (LRU over blocks), sized
from the replica's real KV cache.

Keys are chained block hashes (a block's key covers every token before it), so
one dictionary lookup per block answers "how long a prefix does this replica
hold", as vLLM's own prefix cache does.

A replica's confirmed blocks can be saved and restored (`snapshot` / `restore`):
a new conductor then starts from what the last one knew (app/conductor/index_store.py).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens`."""
    keys = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


class _LRU:
    """Block keys, least recently used first, bounded."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def matched(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def in_order(self) -> list[int]:
        """Least recently used first."""
        return list(self._keys)


class ReplicaCache:
    """One replica's blocks as the conductor knows them.

    `held`: confirmed (the replica computed or received them, its requests
    ended): what a hit estimate may count on. `routed`: requests were sent
    there for them and may not have finished: enough to keep a conversation on
    its replica, never to skip a transfer (a next turn arriving while MD still
    pulls the previous one must not count on blocks MD does not have yet).
    """

    def __init__(self, capacity_blocks: int):
        self.held = _LRU(capacity_blocks)
        self.routed = _LRU(capacity_blocks)
        self.changes = 0
        """Counts changes to `held` (what a snapshot holds)."""

    def hold(self, keys: Sequence[int]) -> None:
        self.held.add(keys)
        self.routed.add(keys)
        self.changes += 1

    def forget_from(self, keys: Sequence[int], first: int) -> None:
        """The replica no longer holds keys[first:] (it reported a shorter hit)."""
        self.held.discard(keys[first:])
        self.routed.discard(keys[first:])
        self.changes += 1

    def __len__(self) -> int:
        return len(self.routed)


@dataclass(frozen=True)
class Choice:
    replica_id: str
    cached_tokens: int
    """Prompt tokens this replica is expected to hold."""


class PrefixIndex:
    def __init__(self, block_size: int, imbalance_limit: int = 8):
        self.block_size = block_size
        self.imbalance_limit = imbalance_limit
        """A replica this many requests busier than the idlest one loses its affinity."""
        self._replicas: dict[str, ReplicaCache] = {}

    def _cache(self, replica_id: str, capacity_blocks: int) -> ReplicaCache:
        cache = self._replicas.get(replica_id)
        if cache is None:
            cache = self._replicas[replica_id] = ReplicaCache(capacity_blocks)
        return cache

    def keys(self, tokens: Sequence[int]) -> list[int]:
        return block_keys(tokens, self.block_size)

    def estimate(self, replica_id: str, keys: Sequence[int]) -> int:
        """Prompt tokens the replica is known to hold (confirmed blocks only)."""
        cache = self._replicas.get(replica_id)
        return 0 if cache is None else cache.held.matched(keys) * self.block_size

    def choose(self, candidates: dict[str, int], keys: Sequence[int], load: Callable[[str], int], room: int = 0) -> Choice:
        """Longest known hit, then the replica the conversation was routed to,
        unless that replica is overloaded; ties go to the idlest, then to the
        emptiest cache, then to a replica picked by rendezvous hashing of the
        prompt's first block: new conversations spread evenly and keep their
        replica turn after turn.

        `candidates` maps live replica ids to their KV capacity in blocks.
        Overloaded: `imbalance_limit` requests busier than the idlest, and
        running at least `room` (`policy.affinity_room`).
        """
        if not candidates:
            raise ValueError("no candidate replicas")
        replicas = self._replicas
        loads = {}
        for rid, capacity in candidates.items():
            if rid not in replicas:
                replicas[rid] = ReplicaCache(capacity)
            loads[rid] = load(rid)
        limit = min(loads.values()) + self.imbalance_limit
        # held blocks first, then routed blocks; each is computed only where it can still decide
        held = {rid: replicas[rid].held.matched(keys) for rid in candidates if loads[rid] <= limit or loads[rid] < room}
        most = max(held.values())
        tied = [rid for rid, blocks in held.items() if blocks == most]
        if len(tied) > 1:
            routed = {rid: replicas[rid].routed.matched(keys) for rid in tied}
            most_routed = max(routed.values())
            tied = [rid for rid in tied if routed[rid] == most_routed]
        best = tied[0]
        if len(tied) > 1:
            first = keys[0] if keys else 0
            best = min(tied, key=lambda rid: (loads[rid], len(replicas[rid]), -zlib.crc32(f"{first}:{rid}".encode())))
        return Choice(best, most * self.block_size)

    def route(self, replica_id: str, keys: Sequence[int], capacity_blocks: int) -> None:
        """A request for these blocks was sent to the replica (not yet confirmed)."""
        self._cache(replica_id, capacity_blocks).routed.add(keys)

    def unroute(self, replica_id: str, keys: Sequence[int]) -> None:
        """The request will not leave these blocks there after all."""
        cache = self._replicas.get(replica_id)
        if cache is not None:
            cache.routed.discard([k for k in keys if k not in cache.held])

    def record(self, replica_id: str, keys: Sequence[int], capacity_blocks: int) -> None:
        """The replica now holds these blocks (it just computed or received them)."""
        self._cache(replica_id, capacity_blocks).hold(keys)

    def observe(self, replica_id: str, keys: Sequence[int], actual_cached_tokens: int) -> None:
        """Correct the index with the hit the engine actually found."""
        cache = self._replicas.get(replica_id)
        if cache is not None and cache.held.matched(keys) * self.block_size > actual_cached_tokens:
            cache.forget_from(keys, actual_cached_tokens // self.block_size)

    def known_replicas(self) -> list[str]:
        return list(self._replicas)

    def changes(self, replica_id: str) -> int:
        """A count that moves whenever the replica's confirmed blocks change (-1: unknown replica)."""
        cache = self._replicas.get(replica_id)
        return -1 if cache is None else cache.changes

    def held_blocks(self, replica_id: str) -> int:
        cache = self._replicas.get(replica_id)
        return 0 if cache is None else len(cache.held)

    def forget_all_but(self, live: set[str]) -> list[str]:
        """Drop the replicas not in `live` (gone: dead, or scaled away); their ids."""
        gone = [rid for rid in self._replicas if rid not in live]
        for rid in gone:
            del self._replicas[rid]
        return gone

    def snapshot(self, replica_id: str) -> tuple[int, list[int]]:
        """A replica's capacity and confirmed blocks, least recently used first."""
        cache = self._replicas[replica_id]
        return cache.held.capacity, cache.held.in_order()

    def restore(self, replica_id: str, capacity_blocks: int, held: list[int]) -> None:
        """A replica's confirmed blocks as `snapshot` gave them."""
        self._cache(replica_id, capacity_blocks).hold(held)
