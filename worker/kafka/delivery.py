"""Delivery: an answer becomes durable (or staged), then its offset is complete; and the commit.

Two strategies, chosen once when the worker starts, each with the next step passed in:

- `AtLeastOnce(producer, consumer, tracker, OffsetDone)`: every record of the answer is sent
  and acknowledged by the broker (idempotent producer, acks=all; a send the broker refuses
  because it is away is retried until it succeeds or the partition is no longer ours); only
  then is the offset complete. Its commit is the consumer group's offset commit of each
  partition's watermark.
- `ExactlyOnce(group_id, producer_factory, tracker, OffsetDone)`: the answer is staged into its
  partition's transaction (transactions.py) and the offset is complete at once; its commit
  writes the staged answers below the watermark together with the watermark, in one
  transaction per partition. A fenced partition (another worker initialised its transactional
  id) is handed to `on_fenced`, which forgets its work.

`OffsetDone` is the last step of both: it completes the offset under the epoch the record was
fetched in (a stale epoch changes nothing), counts and logs the answer, and wakes whoever waits
for in-flight offsets to settle (the drain, a revoke grace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError, OffsetMetadataTooLargeError
from structlog.typing import FilteringBoundLogger

from tokenmill.aio import wait_event
from tokenmill.kafka.attempts import METADATA_BUDGET
from tokenmill.kafka.offsets import CommitSnapshot, OffsetTracker
from tokenmill.kafka.publisher import PublishAbandoned, send_acked
from tokenmill.kafka.retry import KafkaRetry
from tokenmill.kafka.transactions import PartitionFenced, PartitionTransactions
from tokenmill.kafka.types import Answer
from tokenmill.metrics import WorkerMetrics


class OffsetDone:
    """The last step: the answered offset completes in its partition's watermark."""

    def __init__(self, tracker: OffsetTracker[TopicPartition], metrics: WorkerMetrics) -> None:
        self.tracker = tracker
        self.metrics = metrics
        self.answered = 0  # inputs whose answer is durable (or staged, exactly-once), this process
        self.last_answer_at: tuple[float, float] | None = None  # (perf_counter, process_time)
        self._progress = asyncio.Event()  # set whenever an offset completes

    def submit(self, answer: Answer) -> None:
        f = answer.fetched
        if not self.tracker.complete(f.tp, f.epoch, f.offset):
            self.dropped(answer)  # fetched under an older epoch: that offset belongs to a new owner now
            return
        self.answered += 1
        self.last_answer_at = (time.perf_counter(), time.process_time())
        self.metrics.count_answer(answer.outcome, answer.code)
        answer.log.info("answered", status=answer.outcome, code=answer.code)
        self._progress.set()

    def dropped(self, answer: Answer) -> None:
        """An answer that will not be delivered (its partition is no longer ours): its work is lost."""
        if answer.computed_tokens:
            self.metrics.count_discarded(answer.fetched.tp.partition, "answer_dropped", answer.computed_tokens)

    async def settle(self, partitions: Iterable[TopicPartition] | None, timeout_s: float,
                     give_up: Callable[[], bool] = lambda: False) -> int:
        """Wait until the partitions (all when None) have nothing in flight, at most timeout_s
        or until give_up() says nothing more will finish; returns how many are left."""
        chosen = None if partitions is None else list(partitions)

        def in_flight() -> int:
            if chosen is None:
                return self.tracker.in_flight()
            return sum(self.tracker.in_flight(tp) for tp in chosen)

        deadline = time.monotonic() + timeout_s
        while in_flight() and time.monotonic() < deadline and not give_up():
            self._progress.clear()
            await wait_event(self._progress, min(0.5, max(0.01, deadline - time.monotonic())))
        return in_flight()


class MetadataBudget:
    """How many bytes of offset metadata the attempt counts may take (attempts.py). A broker that
    refuses a commit's metadata as too large (its offset.metadata.max.bytes is lower than the
    default) halves it, down to 0: commits without counts, which always go through."""

    def __init__(self, limit: int = METADATA_BUDGET) -> None:
        self.bytes = limit

    def halve(self, log: FilteringBoundLogger) -> None:
        self.bytes = self.bytes // 2 if self.bytes > 64 else 0
        log.error("the broker refused the offset metadata as too large; crash attempt counts now get less room "
                  "(raise offset.metadata.max.bytes to 4096)", metadata_budget=self.bytes)

    def note_dropped(self, tp: TopicPartition, snap: CommitSnapshot, log: FilteringBoundLogger) -> None:
        if snap.dropped and self.bytes:  # with no room at all, halve() has said so once
            log.warning("crash attempt counts over the metadata budget: some left out of the commit",
                        partition=tp.partition, left_out=snap.dropped, metadata_budget=self.bytes)


class Delivery(Protocol):
    """What the worker asks of a delivery mode."""

    async def submit(self, answer: Answer) -> None: ...

    async def commit(self, partitions: Iterable[TopicPartition], settled: bool = False) -> None: ...

    async def partition_assigned(self, tp: TopicPartition) -> None: ...

    async def partition_revoked(self, tp: TopicPartition) -> None: ...

    async def partition_returned(self, tp: TopicPartition, reclaim: bool) -> None: ...

    async def close(self) -> None: ...


@dataclass
class AtLeastOnce:
    """Acknowledged publish, then the next step; commits watermarks through the consumer group."""

    producer: AIOKafkaProducer
    consumer: AIOKafkaConsumer
    tracker: OffsetTracker[TopicPartition]
    next_step: OffsetDone
    log: FilteringBoundLogger
    on_retry: Callable[[BaseException, int], None]  # a send failed and is tried again
    budget: MetadataBudget = field(default_factory=MetadataBudget)  # for the attempt counts

    async def submit(self, answer: Answer) -> None:
        f = answer.fetched
        try:
            for rec in answer.records:
                await send_acked(self.producer, rec, still_wanted=lambda: self.tracker.owns(f.tp, f.epoch),
                                 on_retry=self.on_retry)
        except PublishAbandoned:
            answer.log.info("answer dropped: partition no longer ours")
            self.next_step.dropped(answer)
            return
        self.next_step.submit(answer)

    async def commit(self, partitions: Iterable[TopicPartition], settled: bool = False) -> None:
        snapshots = {}
        for tp in partitions:
            part = self.tracker.get(tp)
            snap = part.commit_snapshot(self.budget.bytes, settled) if part is not None else None
            if snap is not None:
                snapshots[tp] = (part, snap)
                self.budget.note_dropped(tp, snap, self.log)
        if not snapshots:
            return
        try:
            await self.consumer.commit({tp: snap.value() for tp, (_, snap) in snapshots.items()})
        except OffsetMetadataTooLargeError:
            self.budget.halve(self.log)
            return
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            self.log.warning("offset commit failed; will retry", error=repr(exc))
            return
        for tp, (part, snap) in snapshots.items():
            if self.tracker.get(tp) is part:  # not re-assigned meanwhile (a new epoch has its own counts)
                part.mark_committed(snap.offset, snap.version, snap.metadata)

    async def partition_assigned(self, tp: TopicPartition) -> None:
        pass

    async def partition_revoked(self, tp: TopicPartition) -> None:
        pass

    async def partition_returned(self, tp: TopicPartition, reclaim: bool) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class ExactlyOnce:
    """Staging into the partition's transaction, then the next step; commits by transaction."""

    group_id: str
    producer_factory: Callable[[str], AIOKafkaProducer]  # transactional id -> a producer for it
    tracker: OffsetTracker[TopicPartition]
    next_step: OffsetDone
    log: FilteringBoundLogger
    retry: KafkaRetry
    on_fenced: Callable[[TopicPartition], None]  # another worker took the partition over
    budget: MetadataBudget = field(default_factory=MetadataBudget)  # for the attempt counts
    _txns: dict[TopicPartition, PartitionTransactions] = field(default_factory=dict, init=False)

    async def submit(self, answer: Answer) -> None:
        f = answer.fetched
        txn = self._txns.get(f.tp)
        if txn is None or not self.tracker.owns(f.tp, f.epoch):
            self.next_step.dropped(answer)
            return
        txn.add(f.offset, answer.records)
        self.next_step.submit(answer)

    async def commit(self, partitions: Iterable[TopicPartition], settled: bool = False) -> None:
        for tp in partitions:
            txn, part = self._txns.get(tp), self.tracker.get(tp)
            if txn is None or part is None:
                continue
            snap = part.commit_snapshot(self.budget.bytes, settled)
            if snap is None:
                continue  # the offset and its counts are committed already
            self.budget.note_dropped(tp, snap, self.log)
            try:
                await txn.flush(snap.offset, snap.metadata)
                if (txn.last_committed, txn.last_metadata) == (snap.offset, snap.metadata) and \
                        self.tracker.get(tp) is part:
                    part.mark_committed(snap.offset, snap.version, snap.metadata)
            except OffsetMetadataTooLargeError:
                self.budget.halve(self.log)
            except PartitionFenced:
                self.log.warning("partition taken over by another worker; dropping its work", partition=tp.partition)
                self._txns.pop(tp, None)
                self.on_fenced(tp)

    async def partition_assigned(self, tp: TopicPartition) -> None:
        txn = PartitionTransactions(tp, self.group_id, self.producer_factory, self.log)
        # Initialising the id aborts what a previous owner left open; only then is the committed
        # offset final, so the caller reads it afterwards.
        await self.retry(txn.start, f"initialise transactions of partition {tp.partition}")
        self._txns[tp] = txn

    async def partition_revoked(self, tp: TopicPartition) -> None:
        txn = self._txns.pop(tp, None)
        if txn is not None:
            await txn.stop()

    async def partition_returned(self, tp: TopicPartition, reclaim: bool) -> None:
        """A revoked partition came back with its work (rebalance.py): its staged answers stay.
        `reclaim`: another member may have initialised its transactional id meanwhile; initialise
        it again (a new producer), which fences that member and aborts what it left open."""
        txn = self._txns.get(tp)
        if txn is not None and reclaim:
            await self.retry(txn.restart, f"initialise transactions of partition {tp.partition} again")

    async def close(self) -> None:
        for tp in list(self._txns):
            await self._txns.pop(tp).stop()
