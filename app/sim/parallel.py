"""Independent twin runs on several processes: a sweep's points, a comparison's modes, a table's searches.

A run is a pure function of its inputs and seed, so the answers are the same
with any number of processes, and `run_all` returns them in the order of the
inputs. Workers start by spawning (a fork would copy the parent's threads,
such as a progress display's, half-way through what they were doing): each
imports the twin once, about half a second, against runs of seconds to hours.
The function and its inputs cross to the workers by pickle, so the function
must be a module-level one (or a `functools.partial` of one); lambdas and
closures do not cross.

With `on_progress`, the function is called with a second argument, `report`:
what a run passes to it (a count, a probe's figures) reaches `on_progress`
in this process as `(index of the input, what it passed)`, while it runs.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Report = Callable[[Any], None]


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_jobs(jobs: int | None) -> int:
    """`jobs`, or every CPU for None; ValueError naming the option for less than 1."""
    if jobs is None:
        return default_jobs()
    if jobs < 1:
        raise ValueError(f"--jobs: {jobs} is not a number of processes (at least 1)")
    return jobs


class _QueueReport:
    """A worker's `report`: puts (index, value) on the parent's queue."""

    def __init__(self, queue: Any, index: int):
        self.queue, self.index = queue, index

    def __call__(self, value: Any) -> None:
        self.queue.put((self.index, value))


def _relay(queue: Any, on_progress: Callable[[int, Any], None]) -> None:
    while (item := queue.get()) is not None:
        on_progress(*item)


def run_all(
    fn: Callable[..., R],
    items: Iterable[T],
    *,
    jobs: int | None = None,
    on_done: Callable[[int, R], None] | None = None,
    on_progress: Callable[[int, Any], None] | None = None,
) -> list[R]:
    """`fn(item)` (with `on_progress`: `fn(item, report)`) for every item, on up to `jobs`
    processes (None: every CPU; 1: in this process), in the order of `items`.
    `on_done(index, result)` as each finishes. The first failure is raised, and the runs
    not started yet are dropped."""
    items = list(items)
    jobs = min(check_jobs(jobs), len(items))
    results: list[Any] = [None] * len(items)
    if jobs <= 1:
        for i, item in enumerate(items):
            results[i] = fn(item) if on_progress is None else fn(item, lambda value, i=i: on_progress(i, value))
            if on_done is not None:
                on_done(i, results[i])
        return results
    context = multiprocessing.get_context("spawn")
    manager = queue = relay = None
    if on_progress is not None:
        manager = context.Manager()
        queue = manager.Queue()
        relay = threading.Thread(target=_relay, args=(queue, on_progress), daemon=True)
        relay.start()
    try:
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {(pool.submit(fn, item) if queue is None else pool.submit(fn, item, _QueueReport(queue, i))): i for i, item in enumerate(items)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    if (error := future.exception()) is not None:
                        for other in pending:
                            other.cancel()
                        raise error
                    i = futures[future]
                    results[i] = future.result()
                    if on_done is not None:
                        on_done(i, results[i])
    finally:
        if relay is not None:
            assert queue is not None and manager is not None  # set together with the relay
            queue.put(None)
            relay.join()
            manager.shutdown()
    return results
