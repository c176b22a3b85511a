"""Exactly-once answers: one transactional producer per input partition.

aiokafka has no KIP-447 (its transactional offset commit carries the group id only, no member
generation), so a producer cannot be fenced by group membership. Instead each input partition
gets its own transactional id, derived from group, topic and partition. Whoever owns the
partition initialises that id first, which aborts any transaction a crashed or stale owner left
open and fences that owner's producer for good.

Answers (Results, dead letters) of a partition are buffered until the partition's watermark
passes them, then written together with the new committed offset in one short transaction. So
every answer that a `read_committed` reader can see lies below the committed offset: a new owner
restarts above it and never answers those jobs again, and an aborted transaction leaves nothing
visible, so those jobs are answered again exactly once. Token events are not part of this (a
`read_committed` reader would stall behind a long transaction); they stay at-least-once.

The offset goes into the transaction with its metadata (aiokafka's send_offsets_to_transaction
takes (offset, metadata) like a plain commit), so the crash attempt counts (attempts.py) travel
the same way in both delivery modes; a transaction is due when the offset or the metadata moved.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, OffsetMetadataTooLargeError, ProducerFenced
from structlog.typing import FilteringBoundLogger

from tokenmill.kafka.publisher import OutRecord


def transactional_id(group_id: str, topic: str, partition: int) -> str:
    """Stable per (group, topic, partition); long names are shortened with a digest."""
    raw = f"tokenmill.{group_id}.{topic}.{partition}"
    if len(raw) <= 200:
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return f"tokenmill.{digest}.{partition}"


class PartitionFenced(Exception):
    """Another owner initialised this partition's transactional id: our state is void."""


class PartitionTransactions:
    """Buffers one partition's answers and commits them with the offset in one transaction."""

    def __init__(self, tp: TopicPartition, group_id: str, producer_factory: Callable[[str], AIOKafkaProducer],
                 log: FilteringBoundLogger) -> None:
        self.tp = tp
        self.group_id = group_id
        self.txn_id = transactional_id(group_id, tp.topic, tp.partition)
        self._factory = producer_factory
        self._producer: AIOKafkaProducer | None = None
        self._ready: dict[int, list[OutRecord]] = {}
        self.last_committed: int | None = None
        self.last_metadata = ""  # the offset metadata (crash attempt counts) committed with it
        self.log = log.bind(partition=tp.partition, transactional_id=self.txn_id)
        self.transactions = 0
        # The commit task and a rebalance callback may both flush: one transaction at a time.
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Create the producer and initialise the id: aborts a previous owner's open transaction."""
        producer = self._factory(self.txn_id)
        await producer.start()
        self._producer = producer

    async def restart(self) -> None:
        """A new producer for the same id (initialising it again); the staged answers stay."""
        async with self._lock:
            await self._discard_producer()
            await self.start()

    def add(self, offset: int, records: list[OutRecord]) -> None:
        self._ready[offset] = records

    def pending(self) -> int:
        return len(self._ready)

    async def flush(self, commit_point: int | None, metadata: str = "") -> int:
        async with self._lock:
            return await self._flush(commit_point, metadata)

    async def _flush(self, commit_point: int | None, metadata: str) -> int:
        """Publish the answers below commit_point with the offset and its metadata; returns how
        many were sent.

        Raises PartitionFenced when another owner took the partition over, and
        OffsetMetadataTooLargeError when the broker refuses the metadata (after aborting); on
        other Kafka errors the transaction is aborted, the producer replaced, and the answers kept
        for the next try.
        """
        if commit_point is None:
            return 0
        offsets = sorted(o for o in self._ready if o < commit_point)
        if not offsets and commit_point == self.last_committed and metadata == self.last_metadata:
            return 0
        if self._producer is None:
            await self.start()
        producer = self._producer
        assert producer is not None
        try:
            await producer.begin_transaction()
            futures = []
            for off in offsets:
                for rec in self._ready[off]:
                    futures.append(
                        await producer.send(
                            rec.topic, value=rec.value, key=rec.key, headers=rec.headers, partition=rec.partition
                        )
                    )
            offset = (commit_point, metadata) if metadata else commit_point
            await producer.send_offsets_to_transaction({self.tp: offset}, self.group_id)
            await producer.commit_transaction()
            for fut in futures:
                await fut
        except ProducerFenced as exc:
            await self._discard_producer()
            raise PartitionFenced(str(exc)) from exc
        except KafkaError as exc:
            self.log.warning("transaction failed; retrying later", error=repr(exc))
            try:
                await producer.abort_transaction()
            except Exception:
                await self._discard_producer()
            # aiokafka's sender may wrap the broker's answer in its own error.
            for err in (exc, exc.__cause__):
                if isinstance(err, OffsetMetadataTooLargeError):
                    raise err from None
            return 0
        for off in offsets:
            del self._ready[off]
        self.last_committed = commit_point
        self.last_metadata = metadata
        self.transactions += 1
        self.log.debug("transaction committed", answers=len(offsets), committed_offset=commit_point)
        return len(offsets)

    async def _discard_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.stop()
            except Exception:
                pass

    async def stop(self) -> None:
        async with self._lock:
            await self._discard_producer()
