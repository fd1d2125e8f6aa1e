"""One replica's prefix cache: blocks of KV kept after requests end, LRU eviction.

A conversation's blocks on one replica always form a prefix of its token
stream (each turn extends the previous one), so the cache stores one entry per
conversation: how many tokens of its stream the replica holds (whole blocks)
and the conversation generation the entry was written at. Least recently used
entries lose their tail blocks first, as vLLM frees a finished request's blocks
tail first; a partly evicted entry is still a valid, shorter prefix.

Blocks are cached by content, as in vLLM: a request ending leaves the longer
of what it wrote and what the entry already held, and work of an older
generation that lands late (MD catching up on a turn the context has since
been rewritten past) only adds what it shares with the entry's newer stream,
never replacing it.

A request that reuses an entry pins it while it runs (like vLLM's block
reference counts: concurrent turns of one conversation share the blocks);
pinned entries are never evicted. The blocks a request writes are the
caller's reservation until the request ends and they become the entry, so the
cache's limit is the memory running requests leave free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


def usable_tokens(entry_tokens: int, entry_gen: int, prefix_tokens: int, divergences: Sequence[int], gen: int) -> int:
    """Tokens of an entry a prompt of conversation generation `gen` can reuse.

    `divergences[g]` is how many tokens of the stream survived the rewrite
    that started generation g + 1: an entry written at another generation
    holds the prompt's stream only up to the rewrites between the two, in
    either order (a request dispatched before a rewrite may open after it).
    """
    valid = entry_tokens
    for d in divergences[entry_gen:gen] if entry_gen < gen else divergences[gen:entry_gen]:
        if d < valid:
            valid = d
    return valid if valid < prefix_tokens else prefix_tokens


def merged(tokens: int, gen: int, new_tokens: int, new_gen: int, divergences: Sequence[int]) -> tuple[int, int]:
    """An entry of `tokens` at generation `gen` after a request of generation
    `new_gen` leaves `new_tokens`: the newer generation's stream, as far as
    either request's blocks hold it."""
    if new_gen == gen:  # the usual case, without a call (the next branch gives the same)
        return (new_tokens if new_tokens > tokens else tokens), gen
    if new_gen > gen:
        kept = usable_tokens(tokens, gen, tokens, divergences, new_gen)
        return (new_tokens if new_tokens > kept else kept), new_gen
    late = usable_tokens(new_tokens, new_gen, new_tokens, divergences, gen)
    return (late if late > tokens else tokens), gen


class PrefixCache:
    __slots__ = ("limit", "used", "held", "block", "entries", "pinned", "evicted_tokens")

    def __init__(self, limit_tokens: int, block_size: int):
        self.limit = limit_tokens
        self.used = 0
        """Tokens of all entries, pinned or not."""
        self.held = 0
        """Tokens of pinned entries (not evictable)."""
        self.block = block_size
        self.entries: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        """Evictable entries, key -> (tokens, generation), least recently used first."""
        self.pinned: dict[Hashable, list[int]] = {}
        """key -> [tokens, generation, pins]."""
        self.evicted_tokens = 0

    def peek(self, key: Hashable) -> tuple[int, int] | None:
        e = self.entries.get(key)
        if e is not None:
            return e
        p = self.pinned.get(key)
        return None if p is None else (p[0], p[1])

    def pin(self, key: Hashable) -> tuple[int, int] | None:
        """Hold an entry for a running request; None when the cache has none."""
        p = self.pinned.get(key)
        if p is not None:
            p[2] += 1
            return p[0], p[1]
        e = self.entries.pop(key, None)
        if e is not None:
            self.pinned[key] = [e[0], e[1], 1]
            self.held += e[0]
        return e

    def release(self, key: Hashable, tokens: int, gen: int, pinned: bool, divergences: Sequence[int] = ()) -> None:
        """A request ends: its `tokens` join the entry, most recently used."""
        tokens -= tokens % self.block
        p = self.pinned.get(key) if pinned else None
        if p is None:
            self.put(key, tokens, gen, divergences)
            return
        tokens, gen = merged(p[0], p[1], tokens, gen, divergences)
        self.used += tokens - p[0]
        self.held += tokens - p[0]
        p[0], p[1] = tokens, gen
        p[2] -= 1
        if p[2] == 0:
            del self.pinned[key]
            self.held -= tokens
            if tokens > 0:
                self.entries[key] = (tokens, gen)
        self._evict()

    def publish(self, key: Hashable, tokens: int, gen: int, pinned: bool, divergences: Sequence[int] = ()) -> None:
        """A running request's computed blocks join its conversation's entry, which
        it keeps pinned (vLLM caches a block as soon as it is computed)."""
        tokens -= tokens % self.block
        p = self.pinned.get(key)
        if p is None:
            tokens, gen = self._take(key, tokens, gen, divergences)
            self.pinned[key] = [tokens, gen, 1]
            self.used += tokens
            self.held += tokens
            return
        if not pinned:
            p[2] += 1
        tokens, gen = merged(p[0], p[1], tokens, gen, divergences)
        self.used += tokens - p[0]
        self.held += tokens - p[0]
        p[0], p[1] = tokens, gen

    def put(self, key: Hashable, tokens: int, gen: int, divergences: Sequence[int] = ()) -> None:
        """Store a conversation's prefix (merged with its entry) as most recently used."""
        tokens -= tokens % self.block
        p = self.pinned.get(key)
        if p is not None:  # another request still runs on it: update in place
            tokens, gen = merged(p[0], p[1], tokens, gen, divergences)
            self.used += tokens - p[0]
            self.held += tokens - p[0]
            p[0], p[1] = tokens, gen
        else:
            tokens, gen = self._take(key, tokens, gen, divergences)
            if tokens > 0:
                self.entries[key] = (tokens, gen)
                self.used += tokens
        self._evict()

    def _take(self, key: Hashable, tokens: int, gen: int, divergences: Sequence[int]) -> tuple[int, int]:
        """Remove the evictable entry of `key`, if any; the entry `tokens` at `gen` then makes."""
        old = self.entries.pop(key, None)
        if old is None:
            return tokens, gen
        self.used -= old[0]
        return merged(old[0], old[1], tokens, gen, divergences)

    def set_limit(self, limit_tokens: int) -> None:
        self.limit = limit_tokens
        if self.used > limit_tokens:
            self._evict()

    def _evict(self) -> None:
        over = self.used - self.limit
        entries = self.entries
        block = self.block
        while over > 0 and entries:
            key, (tokens, gen) = next(iter(entries.items()))
            drop = -(-over // block) * block
            if drop >= tokens:
                del entries[key]
                drop = tokens
            else:
                entries[key] = (tokens - drop, gen)  # keeps its LRU position
            self.used -= drop
            self.evicted_tokens += drop
            over -= drop
