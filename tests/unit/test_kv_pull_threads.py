"""The connector's pull threads: how many run at once, which waiting pull goes next, shutdown."""

from __future__ import annotations

import threading

import pytest

from app.config import PullOrder
from app.engine.kv.pull_threads import PullThreads


def held_then(order: PullOrder, pulls: list[tuple[int, object]]) -> list[object]:
    """With the only thread held, queue (size, name) pulls; release; the names in the order they ran."""
    threads = PullThreads(1, order)
    started, gate, ran = threading.Event(), threading.Event(), []
    try:
        held = threads.submit(10**6, lambda: started.set() or gate.wait(5))
        assert started.wait(5)
        futures = [threads.submit(size, ran.append, name) for size, name in pulls]
        gate.set()
        assert held.result(5) is True
        for f in futures:
            f.result(5)
        return ran
    finally:
        threads.shutdown()


def sized(sizes: list[int]) -> list[tuple[int, object]]:
    return [(size, size) for size in sizes]


def test_smallest_first_takes_the_fewest_blocks_next_and_equal_sizes_in_arrival_order():
    assert held_then(PullOrder.smallest_first, sized([40, 3, 0, 40, 3, 7])) == [0, 3, 3, 7, 40, 40]
    # sizes tie: arrival order, told apart by identity
    assert held_then(PullOrder.smallest_first, [(2, name) for name in "abcd"]) == list("abcd")


def test_arrival_order_is_first_come_first_served_whatever_the_size():
    assert held_then(PullOrder.arrival, sized([40, 3, 0, 40, 3, 7])) == [40, 3, 0, 40, 3, 7]


def test_at_most_the_configured_number_run_at_once():
    threads = PullThreads(3, PullOrder.smallest_first)
    lock, running, peak, gate = threading.Lock(), [0], [0], threading.Event()

    def pull() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(5)
        with lock:
            running[0] -= 1

    try:
        futures = [threads.submit(1, pull) for _ in range(7)]
        threading.Timer(0.2, gate.set).start()
        for f in futures:
            f.result(5)
    finally:
        threads.shutdown()
    assert peak[0] == 3


def test_a_failing_pull_hands_its_exception_to_its_future_and_the_thread_goes_on():
    threads = PullThreads(1, PullOrder.smallest_first)
    try:
        bad = threads.submit(1, lambda: 1 / 0)
        good = threads.submit(1, lambda: "ok")
        with pytest.raises(ZeroDivisionError):
            bad.result(5)
        assert good.result(5) == "ok"
    finally:
        threads.shutdown()


def test_shutdown_cancels_waiting_pulls_lets_the_running_one_finish_and_refuses_new_ones():
    threads = PullThreads(1, PullOrder.smallest_first)
    started, gate = threading.Event(), threading.Event()
    running = threads.submit(1, lambda: started.set() or gate.wait(5))
    waiting = [threads.submit(1, lambda: None) for _ in range(3)]
    assert started.wait(5)
    threads.shutdown()
    assert all(f.cancelled() for f in waiting)
    gate.set()
    assert running.result(5) is True
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit(1, lambda: None)
    for t in threads._threads:
        t.join(5)
        assert not t.is_alive()
