"""Fetching: the poll task, offset tracking of every record taken, and pause/resume.

The poll task calls `getmany` continuously: aiokafka enforces max.poll.interval.ms as the time
between polls, and polling keeps the group membership alive during a drain, so it never blocks
and never stops; fetching is throttled with `pause()`/`resume()` instead. For each record:

1. Not ours (any more): the partition is not tracked, is in a revoke grace, or the worker stops.
   It is skipped; the next owner reads it from the committed offset.
2. Below this epoch's start, or already tracked (fetched for an older position): skipped, its
   offset is covered by the committed offset or by this epoch's fetching.
3. The partition's in-flight span (fetch position minus commit point) is full: the consumer
   seeks back to this record and pauses the partition; it resumes once the span has halved.
4. Otherwise the offset is tracked as outstanding under the partition's epoch and the record
   goes to intake.

Backpressure pauses every partition while the engine is loaded (waiting requests, held tenant
jobs counted, or KV cache usage above the high-water mark) and resumes them below the low-water
marks (backpressure.py's hysteresis). So does an outage (`broker_away`, set by broker_watch.py):
nothing new is taken while answers cannot be delivered.

After each poll the gauges of assigned and paused partitions and of uncommitted offsets (fetched,
not yet committed: what another worker would read again if this one died now) are refreshed;
fetching is the only step that raises the latter, so a scrape never shows less than the truth.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from structlog.typing import FilteringBoundLogger

from tokenmill.kafka.backpressure import BackpressureGate
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.registry import JobReader
from tokenmill.kafka.security import access_denied
from tokenmill.kafka.types import Fetched
from tokenmill.metrics import HealthState, WorkerMetrics


@dataclass(eq=False)
class Fetcher:
    consumer: AIOKafkaConsumer
    tracker: OffsetTracker[TopicPartition]
    gate: BackpressureGate
    take: Callable[[Fetched], None]  # the next step: intake
    stopping: Callable[[], bool]  # the worker drains: nothing new is taken
    max_records: int  # per poll
    metrics: WorkerMetrics
    health: HealthState
    log: FilteringBoundLogger
    span_paused: set[TopicPartition] = field(default_factory=set, init=False)  # until their span halves
    broker_away: bool = field(default=False, init=False)  # an outage: every partition stays paused
    # (epoch, first offset tracked in it): the floor of what is uncommitted before the epoch's first commit
    _epoch_start: dict[TopicPartition, tuple[int, int]] = field(default_factory=dict, init=False)
    first_fetch_at: tuple[float, float] | None = field(default=None, init=False)  # (perf_counter, process_time)
    reader: JobReader | None = None  # looks up new schema ids of framed Jobs before intake sees them

    async def run(self) -> None:
        consumer = self.consumer
        while True:
            self.health.tick()
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=self.max_records)
            except KafkaError as exc:  # e.g. the broker is away: aiokafka reconnects by itself
                if access_denied(exc) is not None:
                    raise  # a missing ACL for the group or the topic: the worker stops (exit 77)
                self.log.warning("fetch failed; retrying", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            for tp, records in batches.items():
                if not await self._schemas_known(tp, records):
                    continue
                for rec in records:
                    if not self._track(tp, rec):
                        # Span cap reached: rewind to this record and pause the partition.
                        consumer.seek(tp, rec.offset)
                        consumer.pause(tp)
                        self.span_paused.add(tp)
                        break
            self.update_pausing()

    async def _schemas_known(self, tp: TopicPartition, records: list[ConsumerRecord]) -> bool:
        """Look up the schema ids of framed Jobs not seen before (registry.py). While the registry
        does not answer, the partition is read again from these records later: nothing is taken,
        nothing dead-lettered for an outage."""
        reader = self.reader
        if reader is None or not any(reader.needs_lookup(rec.value) for rec in records):
            return True
        if await reader.resolve(rec.value for rec in records):
            return True
        self.log.warning("the schema registry does not answer; reading these records again later",
                         partition=tp.partition, offset=records[0].offset)
        self.consumer.seek(tp, records[0].offset)
        await asyncio.sleep(1.0)
        return False

    def _track(self, tp: TopicPartition, rec: ConsumerRecord) -> bool:
        """Take one fetched record; False if the partition's in-flight span is full."""
        part = self.tracker.get(tp)
        if part is None or part.revoking or self.stopping():
            return True
        if not part.accepts(rec.offset):
            self.log.warning("skipping a record fetched before the current position", partition=tp.partition,
                             offset=rec.offset, expected_from=part.next_expected)
            return True
        if not part.has_room():
            return False
        part.track(rec.offset, getattr(rec, "timestamp", None))
        if self._epoch_start.get(tp, (None,))[0] != part.epoch:
            self._epoch_start[tp] = (part.epoch, rec.offset)
        if self.first_fetch_at is None:
            self.first_fetch_at = (time.perf_counter(), time.process_time())
        self.metrics.jobs_in.inc()
        self.take(Fetched(tp, part.epoch, rec.offset, rec.key, rec.value, getattr(rec, "timestamp", None)))
        return True

    def engine_load(self, waiting: int, kv_usage: float) -> bool:
        """Feed the engine's load to the backpressure gate; True when the gate changed."""
        was_paused = self.gate.paused
        return self.gate.update(waiting, kv_usage) != was_paused

    def set_broker_away(self, away: bool) -> None:
        self.broker_away = away
        self.update_pausing()

    def update_pausing(self) -> None:
        consumer = self.consumer
        assigned = consumer.assignment()
        if not self.stopping():
            self._pause_or_resume(assigned)
        self._observe(assigned)

    def _pause_or_resume(self, assigned: set[TopicPartition]) -> None:
        consumer = self.consumer
        for tp in list(self.span_paused):
            part = self.tracker.get(tp)
            if part is None or part.span() <= part.max_span // 2:
                self.span_paused.discard(tp)
        want_paused = set(assigned) if self.gate.paused or self.broker_away else set(self.span_paused)
        self.metrics.paused.set(1 if self.gate.paused else 0)
        now_paused = consumer.paused()
        to_pause = [tp for tp in assigned if tp in want_paused and tp not in now_paused]
        to_resume = [tp for tp in assigned if tp not in want_paused and tp in now_paused]
        if to_pause:
            consumer.pause(*to_pause)
        if to_resume:
            consumer.resume(*to_resume)

    def pause_all(self) -> None:
        """Stop fetching for good (the drain): the poll task keeps polling, so the membership stays."""
        assigned = self.consumer.assignment()
        if assigned:
            self.consumer.pause(*assigned)

    def _observe(self, assigned: set[TopicPartition]) -> None:
        self.metrics.partitions_assigned.set(len(assigned))
        self.metrics.partitions_paused.set(len(self.consumer.paused() & assigned))
        self.metrics.uncommitted.set(self.uncommitted())

    def uncommitted(self, partitions: Iterable[TopicPartition] | None = None) -> int:
        """Offsets fetched and not committed, over the partitions (every owned one when None)."""
        total = 0
        for tp in self.tracker.partitions() if partitions is None else partitions:
            part = self.tracker.get(tp)
            fetched_to = part.next_expected if part is not None else None
            if part is None or fetched_to is None:
                continue
            floor = part.last_committed
            if floor is None:
                epoch, first = self._epoch_start.get(tp, (None, fetched_to))
                floor = first if epoch == part.epoch else fetched_to
            total += max(0, fetched_to - floor)
        return total

    def forget(self, partitions: set[TopicPartition]) -> None:
        self.span_paused -= partitions
        for tp in partitions:
            self._epoch_start.pop(tp, None)

    def describe(self) -> dict[str, object]:
        return {"paused": sorted(tp.partition for tp in self.consumer.paused()), "gate_paused": self.gate.paused,
                "span_paused": sorted(tp.partition for tp in self.span_paused)}
