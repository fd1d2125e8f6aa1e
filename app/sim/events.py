"""The discrete-event loop: a heap of (time, order, callback, argument).

`order` breaks ties in scheduling order, so a run is a pure function of its
inputs and seed. Callbacks read the current time from `loop.now`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import Any


class Loop:
    __slots__ = ("now", "heap", "order", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self.order = count()
        """Tie-breaker of equal times; hot callers push (t, next(order), fn, arg) themselves."""
        self.events = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self.heap, (t, next(self.order), fn, arg))

    def run(self) -> None:
        heap = self.heap
        pop = heapq.heappop
        n = 0
        while heap:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
        self.events += n
