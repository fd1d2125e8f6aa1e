"""The conductor's routing index in the twin: app/prefix_index.PrefixIndex itself, fed
synthetic block keys.

The real conductor hashes each prompt into chained block keys (a block's key
covers every token before it) and asks `PrefixIndex.choose` for a replica,
`record`s what it routed and `observe`s the hit the engine reports. The twin
makes the same calls on the same class. Its requests carry no tokens, so a
conversation's keys are synthesised with the trace's sharing semantics: block
`i` of a conversation's token stream is `line * STRIDE + i`, where a line is a
run of content; a turn whose prompt rewrites the context past token `p`
(`prefix_tokens < stream`) starts a new line at block `p // block_size`, so the
kept prefix keeps its keys and everything after it gets keys never seen before.

A key list is therefore a few runs of consecutive integers (`KeyChain`), and
`RunReplicaCache` stores a replica's blocks as such runs. It is the index's
per-replica store, the role `prefix_index.ReplicaCache` plays for the real
conductor, with the same behaviour key by key: two LRUs over blocks (`held`:
confirmed; `routed`: sent there), `add` moves keys to the recent end in order
and evicts the oldest blocks past capacity, `discard` drops keys wherever they
are (tests/unit/test_sim_routing.py checks both against prefix_index's classes
on random operations). Why not ReplicaCache itself: it spends a dictionary
operation per block, and with 64-token blocks a 64K-token context is a
thousand blocks per call, several calls per request; runs make each call cost
a few operations per line instead, which keeps a million-request run in
reach. PrefixIndex's own code (choose, route, record, observe, unroute,
estimate) runs unchanged on top.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol, cast

import cython  # Cython's pure-Python shim: the type hints below only matter to the compiled build (app/native.py)

from app.conductor.prefix_index import Choice, PrefixIndex, ReplicaCache

STRIDE = 1 << 24
"""Keys per line: blocks of one run of content (16M blocks, beyond any context)."""


def _first(segs, n: int) -> list[tuple[int, int, int]]:
    """The runs that make up the first `n` keys of `segs`."""
    out = []
    left = n
    for line, a, b in segs:
        if left <= 0:
            break
        take = b - a if b - a < left else left
        out.append((line, a, a + take))
        left -= take
    return out


class KeyChain:
    """An immutable key list made of runs: key `line * STRIDE + i` for i in [a, b) per run."""

    __slots__ = ("segs", "n")

    def __init__(self, segs: tuple[tuple[int, int, int], ...], n: int):
        self.segs = segs
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int | slice) -> int | KeyChain:
        if isinstance(i, slice):
            return self._slice(i)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        for line, a, b in self.segs:
            if i < b - a:
                return line * STRIDE + a + i
            i -= b - a
        raise IndexError(i)

    def __iter__(self) -> Iterator[int]:
        for line, a, b in self.segs:
            base = line * STRIDE
            yield from range(base + a, base + b)

    def _slice(self, sl: slice) -> KeyChain:
        start, stop, step = sl.indices(self.n)
        if step != 1:
            raise ValueError("key chains slice with step 1 only")
        if stop <= start:
            return KeyChain((), 0)
        out = []
        pos = 0
        for line, a, b in self.segs:
            lo, hi = max(start - pos, 0), min(stop - pos, b - a)
            if lo < hi:
                out.append((line, a + lo, a + hi))
            pos += b - a
        return KeyChain(tuple(out), stop - start)

    def position(self, key: int) -> int:
        """Where `key` is in the chain; -1 when it is not."""
        line, i = divmod(key, STRIDE)
        pos = 0
        for seg_line, a, b in self.segs:
            if seg_line == line and a <= i < b:
                return pos + i - a
            pos += b - a
        return -1

    def head(self, n: int) -> KeyChain:
        """The first `n` keys (at most all)."""
        if n >= self.n:
            return self
        return KeyChain(tuple(_first(self.segs, n)), n)


class _Group:
    """Blocks of one line added by one `add` call, as ascending runs [a, b); its
    position in the LRU order is the call's, and within it lower blocks are older."""

    __slots__ = ("gid", "line", "pieces")

    def __init__(self, gid: int, line: int, a: int, b: int):
        self.gid = gid
        self.line = line
        self.pieces = [[a, b]]


class RunLRU:
    """Block keys, least recently used first, bounded: prefix_index._LRU stored as runs."""

    __slots__ = ("capacity", "order", "lines", "total", "_gid")

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, capacity_blocks)
        self.order: OrderedDict[int, _Group] = OrderedDict()
        """Groups, least recently added first."""
        self.lines: dict[int, list[_Group]] = {}
        self.total = 0
        self._gid = 0

    def __len__(self) -> int:
        return self.total

    def __contains__(self, key: int) -> bool:
        line, i = divmod(key, STRIDE)
        for g in self.lines.get(line, ()):
            for x, y in g.pieces:
                if x <= i < y:
                    return True
        return False

    @cython.locals(keys=KeyChain, g=_Group)
    def matched(self, keys: KeyChain) -> int:
        segs = keys.segs
        lines = self.lines
        if not segs or segs[0][0] not in lines:  # most replicas hold nothing of a conversation
            return 0
        n = 0
        for line, a, b in segs:
            groups = lines.get(line)
            if groups is None:
                return n
            pos = a
            if len(groups) == 1 and len(groups[0].pieces) == 1:
                x, y = groups[0].pieces[0]
                if x <= pos < y:
                    pos = y
            else:  # a few runs: follow them from `a` while one continues where the last ended
                moved = True
                while moved and pos < b:
                    moved = False
                    for g in groups:
                        for x, y in g.pieces:
                            if x <= pos < y:
                                pos = y
                                moved = True
            if pos >= b:
                n += b - a
                continue
            return n + pos - a
        return n

    @cython.locals(keys=KeyChain, g=_Group, inside=_Group)
    def add(self, keys: KeyChain) -> None:
        order, lines = self.order, self.lines
        for line, a, b in keys.segs:
            if a >= b:
                continue
            groups = lines.get(line)
            if groups is not None:
                # the usual turn: one group lies inside [a, b) and the others outside it; that
                # group grows to [a, b) and moves whole to the recent end, the others stay
                inside = None
                for g in groups:
                    pieces = g.pieces
                    if pieces[0][0] >= a and pieces[-1][1] <= b:
                        if inside is not None:
                            break
                        inside = g
                    elif pieces[-1][1] > a and pieces[0][0] < b:
                        break
                else:
                    if inside is not None:
                        pieces = inside.pieces
                        held = pieces[0][1] - pieces[0][0] if len(pieces) == 1 else sum(y - x for x, y in pieces)
                        self.total += b - a - held
                        inside.pieces = [[a, b]]
                        order.move_to_end(inside.gid)
                        continue
                self._cut(line, a, b)
                groups = lines.get(line)
            self._gid += 1
            g = _Group(self._gid, line, a, b)
            order[self._gid] = g
            if groups is None:
                lines[line] = [g]
            else:
                groups.append(g)
            self.total += b - a
        if self.total > self.capacity:
            self._evict()

    def _evict(self) -> None:
        order = self.order
        over = self.total - self.capacity
        while over > 0:
            g = next(iter(order.values()))
            piece = g.pieces[0]
            drop = piece[1] - piece[0]
            if drop > over:
                drop = over
                piece[0] += drop
            else:
                del g.pieces[0]
                if not g.pieces:
                    self._remove(g)
            self.total -= drop
            over -= drop

    def discard(self, keys: KeyChain | Iterable[int]) -> None:
        runs: Sequence[Sequence[int]]
        if isinstance(keys, KeyChain):
            runs = keys.segs
        else:  # any keys: cut them as runs of consecutive blocks of one line
            cut: list[list[int]] = []
            for key in keys:
                line, i = divmod(key, STRIDE)
                if cut and cut[-1][0] == line and cut[-1][2] == i:
                    cut[-1][2] = i + 1
                else:
                    cut.append([line, i, i + 1])
            runs = cut
        lines = self.lines
        for line, a, b in runs:
            if line in lines:
                self._cut(line, a, b)

    def _remove(self, g: _Group) -> None:
        del self.order[g.gid]
        groups = self.lines[g.line]
        groups.remove(g)
        if not groups:
            del self.lines[g.line]

    def _cut(self, line: int, a: int, b: int) -> None:
        """Drop blocks [a, b) of `line`; what is left of each group keeps its place."""
        groups = self.lines[line]
        if len(groups) == 1 and len(groups[0].pieces) == 1:
            g = groups[0]
            piece = g.pieces[0]
            x, y = piece
            if y <= a or x >= b:
                return
            if a <= x and y <= b:
                self.total -= y - x
                self._remove(g)
                return
            if b >= y:  # a suffix goes
                piece[1] = a
                self.total -= y - a
                return
            if a <= x:  # a prefix goes
                piece[0] = b
                self.total -= b - x
                return
        for g in list(groups):
            kept = []
            for x, y in g.pieces:
                if y <= a or x >= b:
                    kept.append([x, y])
                    continue
                if x < a:
                    kept.append([x, a])
                if y > b:
                    kept.append([b, y])
                self.total -= (y if y < b else b) - (x if x > a else a)
            if kept:
                g.pieces = kept
            else:
                self._remove(g)


class RunReplicaCache:
    """One replica's blocks as the conductor knows them (prefix_index.ReplicaCache, as runs)."""

    __slots__ = ("held", "routed")

    def __init__(self, capacity_blocks: int):
        self.held = RunLRU(capacity_blocks)
        self.routed = RunLRU(capacity_blocks)

    def hold(self, keys: KeyChain) -> None:
        self.held.add(keys)
        self.routed.add(keys)

    def forget_from(self, keys: KeyChain, first: int) -> None:
        """The replica no longer holds keys[first:] (it reported a shorter hit)."""
        rest = keys[first:]
        assert isinstance(rest, KeyChain)  # a slice of a chain is a chain
        self.held.discard(rest)
        self.routed.discard(rest)

    def __len__(self) -> int:
        return self.routed.total


class RunIndex(Protocol):
    """The PrefixIndex `routing_index` returns, as the twin calls it: its stores are
    RunReplicaCaches, so the keys it takes are KeyChains (a sequence of ints in all but name)."""

    def choose(self, candidates: dict[str, int], keys: KeyChain, load: Callable[[str], int], room: int = 0) -> Choice: ...

    def route(self, replica_id: str, keys: KeyChain, capacity_blocks: int) -> None: ...

    def unroute(self, replica_id: str, keys: KeyChain) -> None: ...

    def record(self, replica_id: str, keys: KeyChain, capacity_blocks: int) -> None: ...

    def observe(self, replica_id: str, keys: KeyChain, actual_cached_tokens: int) -> None: ...


def routing_index(block_size: int, capacities: Mapping[str, int]) -> RunIndex:
    """The conductor's PrefixIndex (its defaults), with a RunReplicaCache per replica.

    `capacities`: replica id -> KV capacity in blocks, what the conductor passes
    as `num_kv_blocks`. Installing the stores up front is the one place the twin
    reaches inside PrefixIndex: its `_cache` then finds them instead of creating
    a ReplicaCache.
    """
    index = PrefixIndex(block_size)
    for rid, capacity in capacities.items():
        # a RunReplicaCache stands in for a ReplicaCache (it has its methods, on KeyChains)
        index._replicas[rid] = cast(ReplicaCache, RunReplicaCache(capacity))  # noqa: SLF001 - see the docstring
    return cast(RunIndex, index)


class Conversation:
    """A conversation's block keys: its token stream as runs of lines."""

    __slots__ = ("segs", "blocks")

    def __init__(self) -> None:
        self.segs: list[tuple[int, int, int]] = []
        self.blocks = 0
        """Full blocks of the stream that have keys."""


class KeyMaker:
    """Assigns conversations their keys, turn by turn."""

    __slots__ = ("block", "_lines")

    def __init__(self, block_size: int):
        self.block = block_size
        self._lines = 0

    def turn(self, conv: Conversation, prefix_tokens: int, stream_tokens: int) -> KeyChain:
        """Keys of the full blocks of a turn's stream (prompt + output, `stream_tokens`),
        whose first `prefix_tokens` repeat the conversation's stream so far."""
        block = self.block
        keep = prefix_tokens // block
        if keep < conv.blocks:  # the context was rewritten past the kept prefix: new content
            conv.segs = _first(conv.segs, keep)
            conv.blocks = keep
            self._new_line(conv)
        elif not conv.segs:
            self._new_line(conv)
        total = stream_tokens // block
        if total > conv.blocks:
            line, a, _ = conv.segs[-1]
            conv.segs[-1] = (line, a, total)
            conv.blocks = total
        return KeyChain(tuple(conv.segs), conv.blocks)

    def _new_line(self, conv: Conversation) -> None:
        self._lines += 1
        conv.segs.append((self._lines, conv.blocks, conv.blocks))
