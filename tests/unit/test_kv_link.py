"""app/engine/kv/link.py's LinkShare: how long each pull needs on the configured link beside the others."""

import random

import pytest

from app.config import PullOrder
from app.engine.kv.link import LinkShare

BW = 1_000_000.0  # bytes/s


def test_a_pull_alone_needs_its_bytes_over_the_bandwidth():
    share = LinkShare(BW)
    share.start("a", 500_000, now=10.0)
    assert share.finish("a", now=12.0) == pytest.approx(0.5)


def test_pulls_started_together_share_the_bandwidth():
    share = LinkShare(BW)
    for name in "abcd":
        share.start(name, 250_000, now=0.0)
    assert [share.finish(name, now=2.0) for name in "abcd"] == pytest.approx([1.0] * 4)


def test_a_pull_joining_halfway_slows_the_first_and_finishes_after_it():
    share = LinkShare(BW)
    share.start("first", 1_000_000, now=0.0)
    share.start("second", 1_000_000, now=0.5)  # first has 0.5 MB left; both at 0.5 MB/s from here
    assert share.finish("first", now=3.0) == pytest.approx(1.5)
    assert share.finish("second", now=3.0) == pytest.approx(1.5)  # 0.5 MB shared (1 s), 0.5 MB alone (0.5 s)


def test_a_pull_reported_before_the_model_moved_it_is_estimated_and_stays_in_the_model():
    share = LinkShare(BW)
    share.start("a", 1_000_000, now=0.0)
    share.start("b", 1_000_000, now=0.0)
    assert share.finish("a", now=1.0) == pytest.approx(2.0)  # 0.5 MB left at 0.5 MB/s
    share.start("c", 500_000, now=1.0)  # still shares with a and b
    assert share.finish("c", now=5.0) == pytest.approx(1.5)


def test_a_pull_that_moved_less_than_planned_gives_its_share_back():
    share = LinkShare(BW)
    share.start("a", 1_000_000, now=0.0)
    share.start("b", 1_000_000, now=0.0)
    share.settle("a", 0, now=0.0)  # its decoder held the prompt: it never moves
    assert share.finish("b", now=5.0) == pytest.approx(1.0)  # alone on the link
    share.start("c", 1_000_000, now=10.0)
    share.start("d", 1_000_000, now=10.0)
    share.settle("c", 600_000, now=11.0)  # 500 KB moved, 100 KB to go, shared
    assert share.finish("d", now=20.0) == pytest.approx(1.2 + 0.4)  # 200 KB shared, then 400 KB alone
    share.start("e", 1_000_000, now=30.0, destination="md-0")
    share.start("f", 1_000_000, now=30.0, destination="md-0")
    share.settle("f", 1_500_000, now=30.0)  # more than planned: the model keeps its plan
    assert share.finish("e", now=40.0) == pytest.approx(2.0)


def test_a_decoders_pulls_beyond_its_slots_wait_and_their_wait_is_not_their_time():
    """As the connector's pull threads: two move at once per decoder, the smallest waiting goes next."""
    share = LinkShare(BW, slots=2, order=PullOrder.smallest_first)
    share.start("a", 500_000, now=0.0, destination="md-0")
    share.start("b", 1_000_000, now=0.0, destination="md-0")
    share.start("big", 900_000, now=0.0, destination="md-0")
    share.start("small", 100_000, now=0.0, destination="md-0")
    share.start("other", 500_000, now=0.0, destination="md-1")  # another decoder: moves at once
    # a, b, other share (1/3 each) until a and other end at 1.5 s; small then moves beside b
    assert share.finish("a", now=10.0) == pytest.approx(1.5)
    assert share.finish("other", now=10.0) == pytest.approx(1.5)
    assert share.finish("small", now=10.0) == pytest.approx(0.2)  # 2 pulls share: 100 KB at 0.5 MB/s
    assert share.finish("b", now=10.0) == pytest.approx(1.5 + 0.2 + (1_000_000 - 500_000 - 100_000) / (BW / 2))
    arrival = LinkShare(BW, slots=1, order=PullOrder.arrival)
    arrival.start("first", 500_000, now=0.0)
    arrival.start("second", 1_000_000, now=0.0)
    arrival.start("third", 100_000, now=0.0)
    assert [arrival.finish(p, now=10.0) for p in ("first", "second", "third")] == pytest.approx([0.5, 1.0, 0.1])


def test_unknown_pulls_are_none_and_unreported_ones_are_bounded():
    share = LinkShare(BW)
    assert share.finish("never", now=1.0) is None
    for i in range(LinkShare.KEEP_FINISHED + 100):
        share.start(f"p{i}", 10, now=float(i))
    share.finish("x", now=1e9)
    assert len(share._finished) == LinkShare.KEEP_FINISHED and not share._moving_since


def test_the_model_moves_bytes_at_the_link_bandwidth_whenever_it_is_busy():
    """Work conservation: whatever the arrivals, the last pull ends when an always-busy
    link would have moved every byte."""
    rng = random.Random(3)
    share = LinkShare(BW, slots=100)
    now, total = 0.0, 0
    pulls = []
    for i in range(40):
        now += rng.uniform(0, 0.01)  # arrivals faster than the link drains them: never idle
        nbytes = rng.randrange(20_000, 200_000)  # each keeps the link busy past the next arrival
        share.start(f"p{i}", nbytes, now)
        pulls.append((f"p{i}", now))
        total += nbytes
    ends = [start + share.finish(name, now=1e6) for name, start in pulls]
    assert max(ends) == pytest.approx(pulls[0][1] + total / BW)
