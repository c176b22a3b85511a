"""The offset watermark: commit point = lowest offset not yet durably answered."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.kafka.offsets import OffsetTracker, PartitionOffsets


def test_commit_point_is_lowest_outstanding_offset():
    p = PartitionOffsets(epoch=1, max_span=100)
    assert p.commit_point() is None  # nothing fetched: nothing to commit
    for off in (10, 11, 12, 13):
        p.track(off)
    assert p.commit_point() == 10
    assert p.complete(12) and p.complete(13)
    assert p.commit_point() == 10  # 10 and 11 still outstanding: 12, 13 must not be committed
    assert p.complete(10)
    assert p.commit_point() == 11
    assert p.complete(11)
    assert p.commit_point() == 14  # all answered: commit one past the highest fetched


def test_gaps_in_offsets_are_allowed():
    p = PartitionOffsets(epoch=1, max_span=100)
    for off in (5, 9, 20):  # compaction / transaction markers leave holes
        p.track(off)
    p.complete(9)
    assert p.commit_point() == 5
    p.complete(5)
    assert p.commit_point() == 20
    p.complete(20)
    assert p.commit_point() == 21


def test_out_of_order_tracking_and_double_completion_are_rejected():
    p = PartitionOffsets(epoch=1, max_span=100)
    p.track(3)
    with pytest.raises(ValueError):
        p.track(2)
    assert p.complete(3)
    assert not p.complete(3)
    assert not p.complete(99)


def test_span_cap():
    p = PartitionOffsets(epoch=1, max_span=3)
    for off in range(3):
        assert p.has_room()
        p.track(off)
    assert not p.has_room()
    p.complete(1)
    assert not p.has_room()  # span counts from the commit point (0), not the number pending
    p.complete(0)
    assert p.span() == 1 and p.has_room()


def test_needs_commit_only_when_the_point_moved():
    p = PartitionOffsets(epoch=1, max_span=10)
    p.track(0)
    assert p.needs_commit()  # point 0 was never committed
    p.mark_committed(0)
    assert not p.needs_commit()
    p.complete(0)
    assert p.needs_commit() and p.commit_point() == 1


def test_epochs_discard_completions_of_revoked_partitions():
    t = OffsetTracker(max_span=10)
    ep = t.assign(["p0", "p1"])
    t.track("p0", ep["p0"], 0)
    t.track("p1", ep["p1"], 0)
    t.revoke(["p0"])
    assert not t.complete("p0", ep["p0"], 0)  # revoked: nothing to complete
    new = t.assign(["p0"])
    assert new["p0"] != ep["p0"]
    t.track("p0", new["p0"], 0)
    assert not t.complete("p0", ep["p0"], 0)  # old epoch's completion must not count now
    assert t.commit_points() == {"p0": 0, "p1": 0}
    assert t.complete("p0", new["p0"], 0)
    assert t.commit_points()["p0"] == 1
    with pytest.raises(KeyError):
        t.track("p0", ep["p0"], 1)


def test_tracker_rejects_a_zero_span():
    with pytest.raises(ValueError):
        OffsetTracker(max_span=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=60), st.randoms())
def test_commit_point_never_passes_an_unanswered_offset(gaps, rnd):
    """Random fetch gaps and completion orders: the commit point is always exactly the smallest
    outstanding offset, and it never moves backwards."""
    p = PartitionOffsets(epoch=1, max_span=10_000)
    offsets, off = [], 0
    for g in gaps:
        off += g
        offsets.append(off)
        p.track(off)
    order = offsets[:]
    rnd.shuffle(order)
    answered: set[int] = set()
    last = p.commit_point()
    for o in order:
        p.complete(o)
        answered.add(o)
        point = p.commit_point()
        outstanding = [x for x in offsets if x not in answered]
        assert point == (min(outstanding) if outstanding else offsets[-1] + 1)
        assert all(x in answered for x in offsets if x < point)
        assert point >= last
        last = point


def test_many_partitions_stay_independent():
    rng = random.Random(7)
    t = OffsetTracker(max_span=1000)
    epochs = t.assign(range(4))
    outstanding = {tp: [] for tp in range(4)}
    for off in range(200):
        tp = rng.randrange(4)
        t.track(tp, epochs[tp], off)
        outstanding[tp].append(off)
    for tp in range(4):
        rng.shuffle(outstanding[tp])
        for off in outstanding[tp][: len(outstanding[tp]) // 2]:
            t.complete(tp, epochs[tp], off)
        left = outstanding[tp][len(outstanding[tp]) // 2 :]
        assert t.get(tp).commit_point() == min(left)
        assert t.in_flight(tp) == len(left)


def test_an_epoch_refuses_records_below_its_start():
    """A record fetched for an older position (before the seek to the committed offset) must not
    become the epoch's first record, or the records between would be committed unanswered."""
    p = PartitionOffsets(epoch=1, max_span=100)
    p.expect_from(40)
    assert not p.accepts(39) and p.accepts(40) and p.accepts(55)
    with pytest.raises(ValueError):
        p.track(12)
    p.track(41)
    assert not p.accepts(41) and p.accepts(42)
    assert p.commit_point() == 41
    with pytest.raises(ValueError):
        p.expect_from(0)
