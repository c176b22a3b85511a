"""Crash attempts: how many times a job was in the engine when a worker died, kept in Kafka itself.

A job that kills its worker (SIGKILL from the OOM killer, a native crash in a kernel) would
otherwise be read again by the next owner of its partition, kill that worker too, and so on
through the whole group. So every partition's offset commit carries, in its metadata string
(OffsetAndMetadata.metadata, stored by the broker with the committed offset; no other store),
the offsets above the commit point whose runs began and did not end cleanly, each with its count.
The owner after a crash reads it together with the committed offset (`read_committed`) and
knows which jobs were in flight each time a worker died.

The counts of one partition (`AttemptCounts`), for offsets not yet answered:

- `begin`: +1 when a job is about to enter the engine. It is written ahead: the job reaches the
  engine only once a commit carrying the new count succeeded (starts.py), so a crash at any
  moment after that finds the count on the broker.
- `end`: -1, back to the previous count, when the run ended cleanly (its final delta came back,
  an error included) or gracefully (aborted: revoked, drained, the partition lost). A job that
  comes back is never charged for a stop the worker chose.
- `forget`: the offset is answered; its count no longer matters.

Offsets below the commit point are answered by definition and never encoded.

Encoding (`encode_counts` / `decode_counts`), relative to the commit point it is committed with:

    metadata := "" | "tm1:" runs | "tm1z:" base64(zlib(runs))
    runs     := run ("," run)*
    run      := gap ["+" length] ["x" attempts]      (decimal; length and attempts default to 1)

A run is `length` consecutive offsets with the same count; `gap` is its first offset minus the
end of the run before it (the commit point for the first). Jobs start in fetch order, so the
offsets in the engine are mostly one or a few runs: 200 jobs in flight after one crash are
`tm1:0+200`. Text over 200 characters is compressed when that makes it shorter. The broker
refuses metadata over `offset.metadata.max.bytes` (4096 by default); the budget here is 4000.
If the counts do not fit (many scattered offsets), entries are left out, lowest counts and then
highest offsets first (a left-out job may be retried once more than the limit; nothing is lost),
and the partition is marked `crowded`: no new job of it starts until its encoding is small
again (starts.py), which keeps leaving-out a rare case. A broker that refuses the metadata as
too large makes the delivery mode halve its budget (down to none at all).
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

PLAIN = "tm1:"
PACKED = "tm1z:"
METADATA_BUDGET = 4000  # bytes; the broker's offset.metadata.max.bytes defaults to 4096
COMPRESS_FROM = 200  # plain text longer than this is compressed (when that is shorter)


class AttemptsFormatError(ValueError):
    """A committed metadata string that is not (or no longer) ours."""


def _runs(commit_point: int, counts: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """(first offset, length, count) of each run of consecutive offsets with one count."""
    runs: list[list[int]] = []
    for offset in sorted(o for o, c in counts.items() if o >= commit_point and c > 0):
        count = counts[offset]
        if runs and runs[-1][0] + runs[-1][1] == offset and runs[-1][2] == count:
            runs[-1][1] += 1
        else:
            runs.append([offset, 1, count])
    return [(first, length, count) for first, length, count in runs]


def _text(commit_point: int, runs: list[tuple[int, int, int]]) -> str:
    if not runs:
        return ""
    parts, cursor = [], commit_point
    for first, length, count in runs:
        part = str(first - cursor)
        if length > 1:
            part += f"+{length}"
        if count > 1:
            part += f"x{count}"
        parts.append(part)
        cursor = first + length
    body = ",".join(parts)
    if len(body) > COMPRESS_FROM:
        packed = base64.b64encode(zlib.compress(body.encode("ascii"), 9)).decode("ascii")
        if len(packed) + len(PACKED) < len(body) + len(PLAIN):
            return PACKED + packed
    return PLAIN + body


@dataclass(frozen=True)
class Encoded:
    metadata: str
    dropped: int  # offsets left out because the counts did not fit the budget


def encode_counts(commit_point: int, counts: Mapping[int, int], budget: int = METADATA_BUDGET) -> Encoded:
    """The metadata string for counts (offset -> attempts) committed with commit_point; at most
    budget bytes. What does not fit is left out, lowest counts and then highest offsets first."""
    kept = {o: c for o, c in counts.items() if o >= commit_point and c > 0}
    if kept and budget <= len(PLAIN):
        return Encoded("", len(kept))
    text = _text(commit_point, _runs(commit_point, kept))
    if len(text) <= budget:
        return Encoded(text, 0)
    order = sorted(kept, key=lambda o: (kept[o], -o))  # the first to leave out
    total, gone = len(kept), 0
    while kept:
        step = max(1, len(kept) // 8)
        for offset in order[gone:gone + step]:
            del kept[offset]
        gone += step
        text = _text(commit_point, _runs(commit_point, kept))
        if len(text) <= budget:
            return Encoded(text, gone)
    return Encoded("", total)


def decode_counts(commit_point: int, metadata: str | None) -> dict[int, int]:
    """offset -> attempts from a committed metadata string ("" or None: none). Raises
    AttemptsFormatError for text this module did not write."""
    if not metadata:
        return {}
    if metadata.startswith(PACKED):
        try:
            body = zlib.decompress(base64.b64decode(metadata[len(PACKED):], validate=True)).decode("ascii")
        except (ValueError, zlib.error) as exc:
            raise AttemptsFormatError(f"undecodable attempt counts: {exc}") from exc
    elif metadata.startswith(PLAIN):
        body = metadata[len(PLAIN):]
    else:
        raise AttemptsFormatError(f"offset metadata not written by tokenmill: {metadata[:40]!r}")
    counts: dict[int, int] = {}
    cursor = commit_point
    for part in body.split(",") if body else ():
        head, _, count = part.partition("x")
        gap, _, length = head.partition("+")
        try:
            first, n, c = cursor + int(gap), int(length or 1), int(count or 1)
        except ValueError as exc:
            raise AttemptsFormatError(f"bad run {part!r} in attempt counts") from exc
        if first < cursor or n < 1 or c < 1:
            raise AttemptsFormatError(f"bad run {part!r} in attempt counts")
        for offset in range(first, first + n):
            counts[offset] = c
        cursor = first + n
    return counts


class AttemptCounts:
    """One partition's crash attempts under one assignment epoch (see the module docstring)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}  # offset -> attempts that began and did not end cleanly
        self._running: set[int] = set()  # began in this epoch and not ended yet
        self.version = 0  # bumped by every change of the counts
        self.committed_version = 0  # the version the last successful commit carried
        self.crowded = False  # the last encoding came near the budget: start nothing new here

    def load(self, counts: Mapping[int, int]) -> None:
        """The counts committed by the previous owner (already on the broker)."""
        self._counts = {o: c for o, c in counts.items() if c > 0}

    def count(self, offset: int) -> int:
        return self._counts.get(offset, 0)

    def __len__(self) -> int:
        return len(self._counts)

    def begin(self, offset: int) -> int:
        """One more attempt of offset begins; returns the version a commit must carry first."""
        self._counts[offset] = self.count(offset) + 1
        self._running.add(offset)
        self.version += 1
        return self.version

    def end(self, offset: int) -> None:
        """The attempt begun last ended cleanly or gracefully: back to the count before it."""
        if offset not in self._running:
            return
        self._running.discard(offset)
        left = self.count(offset) - 1
        if left > 0:
            self._counts[offset] = left
        else:
            self._counts.pop(offset, None)
        self.version += 1

    def forget(self, offset: int) -> None:
        """The offset is answered."""
        self._running.discard(offset)
        if self._counts.pop(offset, None) is not None:
            self.version += 1

    @property
    def changed(self) -> bool:
        """Whether the counts moved since the last successful commit."""
        return self.version != self.committed_version

    def encode(self, commit_point: int, budget: int = METADATA_BUDGET, settled: bool = False) -> Encoded:
        """The metadata for a commit at commit_point; sets `crowded`. Counts below the point
        (answered) are dropped here. `settled`: as if every attempt now running had ended
        gracefully (a rebalance's commit: a job that moves to another worker must not carry a
        count for a run this worker chose to stop)."""
        for offset in [o for o in self._counts if o < commit_point]:
            del self._counts[offset]
            self._running.discard(offset)
        counts = self._counts
        if settled and self._running:
            counts = {o: c - (o in self._running) for o, c in counts.items()}
        encoded = encode_counts(commit_point, counts, budget)
        # With no room at all the counts are off; holding starts back would only slow the engine.
        room = budget > len(PLAIN)
        self.crowded = room and (bool(encoded.dropped) or len(encoded.metadata) > budget * 3 // 4)
        return encoded

    @property
    def running(self) -> int:
        return len(self._running)

    def mark_committed(self, version: int) -> None:
        self.committed_version = max(self.committed_version, version)

    def mark_settled_committed(self) -> None:
        """A settled commit (see encode) went through: the broker holds fewer counts than the
        running attempts need, so nothing waiting for a count goes to the engine, and the next
        commit writes the counts again."""
        if self._running:
            self.committed_version = -1


async def read_committed(consumer, tp) -> tuple[int | None, str]:
    """The group's committed offset of tp and its metadata ((None, "") when nothing is committed).

    aiokafka's `consumer.committed()` returns the offset only; the same OffsetFetch answer, read
    through the consumer's group coordinator, has the metadata too. A consumer without that
    coordinator (not aiokafka's) gives the offset only, and no counts."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "fetch_committed_offsets"):
        return await consumer.committed(tp), ""
    found = await coordinator.fetch_committed_offsets([tp])
    committed = found.get(tp)
    if committed is None or committed.offset < 0:
        return None, ""
    return committed.offset, committed.metadata or ""


async def read_committed_many(consumer, tps) -> dict:
    """read_committed of several partitions in one request (tp -> (offset or None, metadata))."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "fetch_committed_offsets"):
        return {tp: await read_committed(consumer, tp) for tp in tps}
    found = await coordinator.fetch_committed_offsets(list(tps))
    out = {}
    for tp in tps:
        committed = found.get(tp)
        out[tp] = (None, "") if committed is None or committed.offset < 0 else \
            (committed.offset, committed.metadata or "")
    return out
