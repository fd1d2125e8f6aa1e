"""What a simulated engine replica (app/sim/engine.py) works on and with: a
request's lease on its memory, prefill jobs, decoding sequences, the log of
step times that gives each sequence its worst gap, and the host it shares.

Memory: `capacity` KV tokens. A request's `Lease` holds its blocks (the cached
prefix it reuses, then everything it will write, reserved on admission); the
prefix cache keeps the rest of memory and is evicted as reservations grow.
When nothing runs, the head of the queue is admitted even if it alone
exceeds memory, so a huge request delays others instead of wedging the replica.

Worst gaps: step times (an epoch's longest step stands for its steps) are kept
as suffix maxima, so the worst step since a sequence joined is one binary
search away.

CPU sharing: replicas on one `Host` (engines of a CPU dev cluster, all on one
machine) slow each other down. A step runs `1 + neighbor_slowdown * k` times
as long as its model gives, k the host's other busy replicas (`neighbor_slowdown`:
the replica's fitted model, app/sim/fitting.py `fit_to_app_steps`). When k
changes, a step in flight finishes its remaining share at the new rate, and a
decode epoch ends at its next step boundary and is planned again.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Sequence
from typing import Any

WAITING, RUNNING, DONE = 0, 1, 2
_TRIM = 1 << 12


class Lease:
    """A request's hold on one replica: the cached prefix it reuses (pinned) and
    the memory reserved for the tokens it writes."""

    __slots__ = ("key", "hit", "held", "pinned", "divergences")

    def __init__(self, key: Hashable, hit: int, pinned: bool, divergences: Sequence[int]):
        self.key = key
        self.hit = hit
        self.held = 0
        self.pinned = pinned
        self.divergences = divergences
        """The conversation's rewrites (app/sim/cache.usable_tokens), as they grow."""


class PrefillJob:
    """Tokens to compute for one request (a prompt, or an extend step's tokens).

    `cb(job)` runs when the last chunk's step ends: that step samples a token.
    """

    __slots__ = ("owner", "left", "ctx", "need", "lease", "cb", "admitted")

    def __init__(self, owner: Any, tokens: int, ctx: int, need: int, lease: Lease, cb: Callable[[PrefillJob], None]):
        self.owner = owner
        self.left = tokens
        self.ctx = ctx
        self.need = need
        self.lease = lease
        self.cb = cb
        self.admitted = False


class Seq:
    """One request decoding `n` tokens here from a context of `ctx` tokens.

    `cb(seq, worst_step_s)` runs at its last token (time `loop.now`); `t_first`
    is when it produced its first token here.

    `prefills_first`: the sequence's KV was pulled up to its last prompt token,
    which it computes itself (the PDD connector never pulls the token a decoder
    continues from), so its first step here is a one-token prefill chunk after
    a prefix, priced as such, not a decode step.
    """

    __slots__ = ("owner", "ctx", "n", "need", "lease", "cb", "state", "join", "fin", "t_first", "log0", "inst", "prefills_first")

    def __init__(self, owner: Any, ctx: int, n: int, need: int, lease: Lease, cb: Callable[[Seq, float], None], prefills_first: bool = False):
        self.owner = owner
        self.ctx = ctx
        self.n = n
        self.need = need
        self.lease = lease
        self.cb = cb
        self.state = WAITING
        self.join = 0
        self.fin = 0
        self.t_first = 0.0
        self.log0 = 0
        self.inst: Any = None
        """The replica it was submitted to (app.sim.engine.Instance)."""
        self.prefills_first = prefills_first


class StepLog:
    """Step records (a step, or an epoch's longest step) as suffix maxima."""

    __slots__ = ("n", "idx", "worst", "trim_at")

    def __init__(self) -> None:
        self.n = 0
        """Records so far."""
        self.idx: list[int] = []
        self.worst: list[float] = []
        """Records longer than every later one (indices ascending, times descending)."""
        self.trim_at = _TRIM

    def note(self, dt: float) -> bool:
        """Record a step of `dt` seconds; True when the log should be trimmed."""
        idx, worst = self.idx, self.worst
        while worst and worst[-1] <= dt:
            worst.pop()
            idx.pop()
        idx.append(self.n)
        worst.append(dt)
        self.n += 1
        return len(idx) > self.trim_at

    def worst_since(self, log0: int) -> float:
        j = bisect_left(self.idx, log0)
        return self.worst[j] if j < len(self.worst) else 0.0

    def forget_before(self, oldest: int) -> None:
        """Drop records older than `oldest` (after a long run of shrinking steps)."""
        j = bisect_left(self.idx, oldest)
        del self.idx[:j], self.worst[:j]
        self.trim_at = max(_TRIM, 2 * len(self.idx))


class Host:
    """Replicas sharing one machine's CPU; `busy` counts those with a step in flight."""

    __slots__ = ("members", "busy")

    def __init__(self) -> None:
        self.members: list[Any] = []
        self.busy = 0

    def join(self, inst: Any) -> None:
        self.members.append(inst)
        inst.host = self

    def changed(self, inst: Any, now: float) -> None:
        """`inst` became busy or idle: the others' steps in flight run at a new rate."""
        for other in self.members:
            if other is not inst:
                other._rescale(now)
