"""Rebalancing: taking partitions over, and letting them go, without answering a job twice in one
owner's watermark.

Assigned (for the jobs topic only):

1. The delivery mode prepares the partition (exactly-once: initialising its transactional id,
   which aborts what a previous owner left open, so the committed offset read next is final).
2. The start position is read: the committed offset, or the beginning when nothing was
   committed (retried while the broker is away); with the offset, its metadata: the crash
   attempt counts the previous owners committed (attempts.py), which the new epoch starts with.
3. With no await in between, the consumer seeks there and the tracker starts a new epoch that
   expects offsets from there. aiokafka may hand out records of a new assignment while this
   callback still runs; until the epoch starts they are skipped, so nothing is read twice.

Revoked (those we own):

1. The partitions are marked revoking: fetch takes nothing new from them and the commit task
   leaves them alone.
2. Their in-flight jobs get --revoke-grace (--drain-timeout when the worker is stopping) to
   finish and be delivered.
3. The rest is aborted in the engine (a graceful end: those jobs' crash attempts go back to what
   they were), then their watermarks and counts are committed (or their transactions) and the
   partitions forgotten: the new owner reads them again from the committed offset. Anything of
   theirs that completes later carries a stale epoch and is dropped.

`lost` is the same forgetting for a partition taken over without a revoke (exactly-once: another
worker fenced its transactional id). Nothing can be committed for it any more, so its jobs that
were in the engine count one crash attempt with the new owner, as if this worker had died.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from structlog.typing import FilteringBoundLogger

from tokenmill.config import WorkerSettings
from tokenmill.kafka.attempts import AttemptsFormatError, decode_counts, read_committed
from tokenmill.kafka.delivery import Delivery, OffsetDone
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.retry import KafkaRetry
from tokenmill.metrics import HealthState


@dataclass(eq=False)
class Rebalance(ConsumerRebalanceListener):
    settings: WorkerSettings
    consumer: AIOKafkaConsumer
    tracker: OffsetTracker[TopicPartition]
    delivery: Delivery
    done: OffsetDone  # waits for in-flight offsets to settle (the revoke grace)
    inflight: InFlight
    retry: KafkaRetry
    stopping: Callable[[], bool]  # the worker is draining: the grace is the drain timeout
    forget: Callable[[set[TopicPartition]], None]  # drops what other steps keep per partition
    health: HealthState
    log: FilteringBoundLogger

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        assigned = {tp for tp in assigned if tp.topic == self.settings.jobs_topic}
        starts: dict[TopicPartition, tuple[int, dict[int, int]]] = {}
        for tp in assigned:
            await self.delivery.partition_assigned(tp)
            starts[tp] = await self._start_position(tp)
        # No await from here on (see the module docstring, step 3).
        for tp, (start, _) in starts.items():
            self.consumer.seek(tp, start)
        epochs = self.tracker.assign(assigned)
        for tp, (start, counts) in starts.items():
            self.tracker.expect_from(tp, start)
            self.tracker.get(tp).attempts.load(counts)
        if self.stopping() and assigned:
            self.consumer.pause(*assigned)
        self.health.group_joined = True
        self.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned),
                      epochs=list(epochs.values()), start_offsets={tp.partition: o for tp, (o, _) in starts.items()},
                      crash_attempts={tp.partition: c for tp, (_, c) in starts.items() if c})

    async def _start_position(self, tp: TopicPartition) -> tuple[int, dict[int, int]]:
        """The committed offset and its crash attempt counts, or the beginning when nothing was
        committed."""
        committed, metadata = await self.retry(partial(read_committed, self.consumer, tp), "read the committed offset")
        if committed is not None:
            try:
                return committed, decode_counts(committed, metadata)
            except AttemptsFormatError as exc:
                self.log.warning("committed offset metadata unreadable; no crash attempts known",
                                 partition=tp.partition, error=str(exc))
                return committed, {}
        beginning = await self.retry(partial(self.consumer.beginning_offsets, [tp]), "read the beginning offset")
        return beginning[tp], {}

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        parts = {tp: part for tp in revoked if (part := self.tracker.get(tp)) is not None}
        if not parts:
            return
        owned = set(parts)
        for part in parts.values():
            part.revoking = True
        grace = self.settings.drain_timeout_s if self.stopping() else self.settings.revoke_grace_s
        await self.done.settle(owned, grace)
        abandoned = self.inflight.abandon_where(lambda job: job.fetched.tp in owned)
        await self.delivery.commit(owned)
        for tp in owned:
            await self.delivery.partition_revoked(tp)
        self.forget(owned)
        self.tracker.revoke(owned)
        self.log.info(
            "partitions revoked", partitions=sorted(tp.partition for tp in owned), abandoned_in_flight=abandoned
        )

    def lost(self, tp: TopicPartition) -> None:
        self.inflight.abandon_where(lambda job: job.fetched.tp == tp)
        self.tracker.revoke([tp])
