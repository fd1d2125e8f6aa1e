"""A decoding engine's pull threads: a fixed number of pulls move at once, and a
freed thread takes the next waiting one in `PullOrder`.

concurrent.futures' pool serves only in arrival order; under a burst of cold
prompts that keeps a high-hit turn's few blocks behind gigabytes of other pulls.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from app.config import PullOrder

T = TypeVar("T")

_STOP = -1
"""Sorts before every pull (sizes are >= 0): a stopping thread does not wait for the queue to drain."""


class PullThreads:
    def __init__(self, threads: int, order: PullOrder):
        self._order = order
        self._queue: queue.PriorityQueue[tuple[int, int, Future | None, Callable[..., Any] | None, tuple]] = queue.PriorityQueue()
        self._tickets = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"pdd-kv-pull-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, size: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on a pull thread; `size` (blocks to move) orders it under `smallest_first`."""
        if self._closed:
            raise RuntimeError("pull threads are shut down")
        fut: Future[T] = Future()
        key = size if self._order is PullOrder.smallest_first else 0
        self._queue.put((key, next(self._tickets), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self._queue.get()
            if fut is None or fn is None:  # the stop item
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the future's owner, as concurrent.futures does
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel the waiting pulls and stop each thread after its current one."""
        self._closed = True
        while True:
            try:
                _, _, fut, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                fut.cancel()
        for _ in self._threads:
            self._queue.put((_STOP, next(self._tickets), None, None, ()))
