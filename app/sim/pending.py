"""MD work later turns wait for: the twin's Placement.track_warm / pending_warm / await_warm.

A main decoder's warm-up (P-RLD-MD), or its catch-up on a turn the relay
finished, is tracked by its last block key on its replica. A later turn whose
prompt covers one of those keys counts the blocks as held and starts its own
pull when that work ends, or after kv.transfer_timeout_s, whichever is first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.sim.events import Loop
from app.sim.routing import KeyChain


class Warm:
    """One piece of MD work in flight."""

    __slots__ = ("key", "waiters")

    def __init__(self, key: int):
        self.key = key
        self.waiters: list[list] | None = []
        """[continuation, argument] pairs to run when it ends; None once it has."""


class PendingMDWork:
    def __init__(self, loop: Loop, timeout_s: float):
        self.loop = loop
        self.timeout_s = timeout_s
        self._warms: dict[str, dict[int, Warm]] = {}
        """Replica name -> last block key -> work in flight (as app/conductor/placement.py tracks them)."""

    def track(self, replica: str, keys: KeyChain) -> Warm | None:
        if not keys:
            return None
        last = keys[-1]
        assert isinstance(last, int)  # an index, not a slice: one key
        warm = Warm(last)
        self._warms.setdefault(replica, {})[warm.key] = warm
        return warm

    def covering(self, replica: str, keys: KeyChain) -> tuple[Warm | None, int]:
        """The work in flight covering the longest prefix of `keys`, and how many blocks it covers."""
        best, covered = None, 0
        warms = self._warms.get(replica)
        if warms:
            for key, warm in warms.items():
                n = keys.position(key) + 1
                if n > covered:
                    best, covered = warm, n
        return best, covered

    def done(self, replica: str, warm: Warm | None) -> None:
        if warm is None:
            return
        warms = self._warms[replica]
        if warms.get(warm.key) is warm:
            del warms[warm.key]
        waiters, warm.waiters = warm.waiters, None
        assert waiters is not None  # a piece of work ends once
        for waiter in waiters:
            _wake(waiter)

    def after(self, warm: Warm | None, then: Callable[[Any], None], arg: Any) -> None:
        """`then(arg)` once `warm` ends, or after the timeout, whichever is first."""
        if warm is None or warm.waiters is None:
            then(arg)
            return
        waiter = [then, arg]
        warm.waiters.append(waiter)
        self.loop.at(self.loop.now + self.timeout_s, _wake, waiter)


def _wake(waiter: list) -> None:
    then = waiter[0]
    if then is not None:
        waiter[0] = None
        then(waiter[1])
