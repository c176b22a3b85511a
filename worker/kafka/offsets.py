"""Per-partition offset watermarks for out-of-order completion.

Jobs of one partition finish in any order, but Kafka stores one committed offset per partition:
"everything below this is done". So the offset we may commit is the lowest offset that was fetched
and is not yet durably answered (or, when nothing is outstanding, one past the highest fetched).

Offsets are not assumed contiguous: compaction and transaction markers leave gaps, so the tracker
only reasons about offsets it has actually seen.

Every assignment of a partition gets a new epoch. Work carries the epoch it was fetched under; a
completion from an older epoch (the partition was revoked, maybe re-assigned since) is ignored,
because that offset now belongs to a new round of fetching.

A partition in a rebalance's revoke grace is still owned (its in-flight jobs may finish and their
offsets complete) but marked `revoking`: nothing new is taken from it and the periodic commit
leaves it to the rebalance, which commits it once more before letting it go.

Each partition also keeps its crash attempts (attempts.py): the offsets above the commit point
that are in the engine, or were each time a worker died, with their counts. They travel in the
commit's metadata, so a commit is due when the point moved or the counts changed
(`commit_snapshot`); an answered offset's count is forgotten.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenmill.kafka.attempts import METADATA_BUDGET, AttemptCounts

K = TypeVar("K", bound=Hashable)  # a partition id (a TopicPartition in the worker)


@dataclass
class PartitionOffsets:
    """Outstanding offsets of one partition under one assignment epoch."""

    epoch: int
    max_span: int
    _pending: set[int] = field(default_factory=set)
    _heap: list[int] = field(default_factory=list)  # lazy-deletion min-heap over _pending
    _next_fetch: int | None = None  # one past the highest tracked offset
    _base: int | None = None  # first offset tracked in this epoch
    _start: int | None = None  # where this epoch's fetching begins (committed offset), if known
    last_committed: int | None = None
    # What the group's committed offset of this partition holds if nobody else committed since: the
    # (offset, metadata) found at assignment, then each of this owner's commits. A rebalance that
    # gives the partition back keeps its work only when the broker still holds this (rebalance.py).
    expected_commit: tuple[int | None, str] = (None, "")
    revoking: bool = False  # revoked, the new assignment not known yet: answers complete, nothing new is taken
    attempts: AttemptCounts = field(default_factory=AttemptCounts)  # crash attempts, in the commit's metadata
    _stamps: dict[int, int] = field(default_factory=dict)  # offset -> record timestamp (ms), while pending

    def expect_from(self, offset: int | None) -> None:
        """The epoch's start position (the committed offset), if known: lower offsets are refused."""
        if self._next_fetch is not None:
            raise ValueError("expect_from must be called before the first offset is tracked")
        self._start = offset

    @property
    def next_expected(self) -> int | None:
        return self._next_fetch if self._next_fetch is not None else self._start

    def accepts(self, offset: int) -> bool:
        """Whether offset may be tracked next: at or after the start and above everything tracked."""
        floor = self.next_expected
        return floor is None or offset >= floor

    def track(self, offset: int, timestamp_ms: int | None = None) -> None:
        """Record a fetched offset as outstanding. Offsets must arrive in increasing order."""
        if not self.accepts(offset):
            raise ValueError(f"offset {offset} tracked out of order (next expected >= {self.next_expected})")
        if self._base is None:
            self._base = offset
        self._pending.add(offset)
        if timestamp_ms is not None and timestamp_ms >= 0:
            self._stamps[offset] = timestamp_ms
        heapq.heappush(self._heap, offset)
        self._next_fetch = offset + 1

    def complete(self, offset: int) -> bool:
        """Mark an offset durably answered. Returns False if it was not outstanding."""
        if offset not in self._pending:
            return False
        self._pending.remove(offset)
        self._stamps.pop(offset, None)
        self.attempts.forget(offset)
        while self._heap and self._heap[0] not in self._pending:
            heapq.heappop(self._heap)
        return True

    def is_pending(self, offset: int) -> bool:
        return offset in self._pending

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def oldest_pending_timestamp_ms(self) -> int | None:
        """The timestamp of the lowest offset not yet answered (None: nothing pending, or no timestamp)."""
        return self._stamps.get(self._heap[0]) if self._heap else None

    def commit_point(self) -> int | None:
        """The offset to commit (next record to read after a restart), or None if nothing fetched."""
        if self._heap:
            return self._heap[0]
        return self._next_fetch

    def span(self) -> int:
        """How many offsets lie between the commit point and the next fetch position."""
        point = self.commit_point()
        if point is None or self._next_fetch is None:
            return 0
        return self._next_fetch - point

    def has_room(self) -> bool:
        """True while one more offset may be tracked without exceeding the in-flight span cap."""
        return self.span() < self.max_span

    def needs_commit(self) -> bool:
        point = self.commit_point()
        return point is not None and (point != self.last_committed or self.attempts.changed)

    def commit_snapshot(self, budget: int = METADATA_BUDGET, settled: bool = False) -> CommitSnapshot | None:
        """What to commit now (the point, its metadata, the counts' version), None if nothing.
        `settled`: the counts as if every running attempt had ended (attempts.py; a rebalance)."""
        if not self.needs_commit() and not (settled and self.attempts.running):
            return None
        point = self.commit_point()
        assert point is not None
        encoded = self.attempts.encode(point, budget, settled=settled)
        version = SETTLED if settled and self.attempts.running else self.attempts.version
        return CommitSnapshot(point, encoded.metadata, version, encoded.dropped)

    def mark_committed(self, offset: int, attempts_version: int | None = None, metadata: str = "") -> None:
        self.last_committed = offset
        self.expected_commit = (offset, metadata)
        if attempts_version == SETTLED:
            self.attempts.mark_settled_committed()
        elif attempts_version is not None:
            self.attempts.mark_committed(attempts_version)


SETTLED = -1  # a CommitSnapshot's version when its counts leave out the running attempts


@dataclass(frozen=True)
class CommitSnapshot:
    """One partition's commit: the offset, the attempt counts' metadata, and their version."""

    offset: int
    metadata: str
    version: int
    dropped: int = 0  # counts left out of the metadata (over the budget)

    def value(self) -> int | tuple[int, str]:
        """As aiokafka takes it: the offset alone when there is no metadata."""
        return (self.offset, self.metadata) if self.metadata else self.offset


class OffsetTracker(Generic[K]):
    """Watermarks of every partition this member owns, keyed by any hashable partition id."""

    def __init__(self, max_span: int) -> None:
        if max_span < 1:
            raise ValueError("max_span (in-flight offsets per partition) must be >= 1")
        self.max_span = max_span
        self._parts: dict[K, PartitionOffsets] = {}
        self._epoch = 0

    def assign(self, partitions: Iterable[K]) -> dict[K, int]:
        """Start a new epoch for each partition; returns partition -> epoch."""
        epochs = {}
        for tp in partitions:
            self._epoch += 1
            self._parts[tp] = PartitionOffsets(epoch=self._epoch, max_span=self.max_span)
            epochs[tp] = self._epoch
        return epochs

    def revoke(self, partitions: Iterable[K]) -> None:
        for tp in partitions:
            self._parts.pop(tp, None)

    def get(self, tp: K, epoch: int | None = None) -> PartitionOffsets | None:
        """The partition's state, or None if not owned (or owned under a different epoch)."""
        part = self._parts.get(tp)
        if part is None or (epoch is not None and part.epoch != epoch):
            return None
        return part

    def expect_from(self, tp: K, offset: int | None) -> None:
        """The start position of the partition's current epoch (see PartitionOffsets.expect_from)."""
        part = self._parts.get(tp)
        if part is None:
            raise KeyError(f"partition {tp} is not owned")
        part.expect_from(offset)

    def attempts(self, tp: K, epoch: int, offset: int) -> int:
        """The crash attempts of an offset (0 when not owned under epoch)."""
        part = self.get(tp, epoch)
        return part.attempts.count(offset) if part else 0

    def owns(self, tp: K, epoch: int) -> bool:
        """Whether work fetched under epoch still counts (the partition was not revoked since)."""
        return self.get(tp, epoch) is not None

    def epoch(self, tp: K) -> int | None:
        part = self._parts.get(tp)
        return part.epoch if part else None

    def track(self, tp: K, epoch: int, offset: int, timestamp_ms: int | None = None) -> None:
        part = self.get(tp, epoch)
        if part is None:
            raise KeyError(f"partition {tp} is not owned under epoch {epoch}")
        part.track(offset, timestamp_ms)

    def complete(self, tp: K, epoch: int, offset: int) -> bool:
        """Mark done; returns False (and changes nothing) for a stale epoch or unknown offset."""
        part = self.get(tp, epoch)
        return part.complete(offset) if part else False

    def partitions(self) -> list[K]:
        return list(self._parts)

    def committable(self) -> list[K]:
        """The partitions this owner may commit now: not revoked (a revoked one waits for the
        new assignment to say whether it stays)."""
        return [tp for tp, part in self._parts.items() if not part.revoking]

    def last_committed(self) -> dict[K, int | None]:
        """The offset last committed for each owned partition (None before the first commit)."""
        return {tp: part.last_committed for tp, part in self._parts.items()}

    def commit_points(self, only_changed: bool = True) -> dict[K, int]:
        out = {}
        for tp, part in self._parts.items():
            point = part.commit_point()
            if point is None:
                continue
            if only_changed and not part.needs_commit():
                continue
            out[tp] = point
        return out

    def in_flight(self, tp: K | None = None) -> int:
        if tp is not None:
            part = self._parts.get(tp)
            return part.in_flight if part else 0
        return sum(p.in_flight for p in self._parts.values())
