"""Rebalancing without lost work: a revoked partition keeps its work until the new assignment
says where it goes; only what left this worker is aborted.

aiokafka speaks only the eager protocol: every rebalance revokes every partition of every member,
then hands out a new assignment. The group uses the sticky assignor (clients.py), which keeps
partitions where they were, so most revoked partitions come straight back. So the abort waits
for the assignment that follows.

Revoked (those we own), while the worker runs:

1. The partitions are marked revoking: fetch takes nothing new from them, the commit task and a
   drain leave them alone. Their jobs run on, held ones start (starts.py: without waiting for a
   commit of their crash attempt, which cannot be made now; it goes with the first commit after
   the partition comes back), and their answers are delivered.
2. With --revoke-grace, their in-flight jobs get that long to finish first (0 by default: the
   work is kept, so waiting only delays the group).
3. Their watermarks are committed, with the crash attempt counts as if every job in the engine
   had ended (a job that moves on must not carry a count for a run this worker chose to stop).
   The generation and what was committed are remembered.

Assigned (the jobs topic only), in this order:

1. A revoked partition that is not in the new assignment went elsewhere: its jobs are aborted
   in the engine (a graceful end), it is forgotten, and nothing more is committed for it (it is
   another member's now). Its new owner reads it from the watermark committed at the revoke.
2. A revoked partition that came back keeps its work if nobody else answered any of it: the
   broker still holds the offset and metadata this worker last committed (or found). Then its
   epoch, tracker state, in-flight jobs and exactly-once transaction go on (when a generation
   went by without this worker, the transactional id is initialised again first: a member that
   had the partition meanwhile may have taken it, and answered nothing), the consumer seeks to
   where fetching stopped (nothing is fetched twice, nothing skipped), and its held jobs start
   again. Otherwise it is given up as in step 1 and taken anew as in step 3.
3. A partition new to this worker: the delivery mode prepares it (exactly-once: initialising its
   transactional id, which aborts what a previous owner left open, so the committed offset read
   next is final), the start position is read (the committed offset, or the beginning when
   nothing was committed; retried while the broker is away) with its metadata (the crash attempt
   counts, attempts.py), and, with no await in between, the consumer seeks there and the tracker
   starts a new epoch that expects offsets from there. aiokafka may hand out records of a new
   assignment while this callback still runs; until the epoch starts they are skipped.

While stopping (a drain), a revoke is final: the in-flight jobs get --drain-timeout, the rest is
aborted, the watermarks committed and the partitions forgotten, as before.

`lost` is the same forgetting for a partition taken over without a revoke (exactly-once: another
worker fenced its transactional id). Nothing can be committed for it any more, so its jobs that
were in the engine count one crash attempt with the new owner, as if this worker had died.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from structlog.typing import FilteringBoundLogger

from tokenmill.config import WorkerSettings
from tokenmill.kafka.attempts import AttemptsFormatError, decode_counts, read_committed, read_committed_many
from tokenmill.kafka.delivery import Delivery, OffsetDone
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.retry import KafkaRetry
from tokenmill.metrics import HealthState


def generation_of(consumer: AIOKafkaConsumer) -> int | None:
    """The group generation the consumer is in (None where the client does not say)."""
    generation = getattr(getattr(consumer, "_coordinator", None), "generation", None)
    return generation if isinstance(generation, int) and generation >= 0 else None


@dataclass(eq=False)
class Rebalance(ConsumerRebalanceListener):
    settings: WorkerSettings
    consumer: AIOKafkaConsumer
    tracker: OffsetTracker[TopicPartition]
    delivery: Delivery
    done: OffsetDone  # waits for in-flight offsets to settle (the revoke grace, a drain)
    inflight: InFlight
    retry: KafkaRetry
    stopping: Callable[[], bool]  # the worker is draining: a revoke is final
    forget: Callable[[set[TopicPartition]], None]  # drops what other steps keep per partition
    health: HealthState
    log: FilteringBoundLogger
    wake_commit: Callable[[], None] = lambda: None  # held jobs of a partition that came back may start
    _kept: set[TopicPartition] = field(default_factory=set, init=False)  # revoked, awaiting the assignment
    _revoked_in: int | None = field(default=None, init=False)  # the generation they were revoked from
    # What _start_position found committed, until the new epoch records it as expected_commit.
    _found: dict[TopicPartition, tuple[int | None, str]] = field(default_factory=dict, init=False)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        assigned = {tp for tp in assigned if tp.topic == self.settings.jobs_topic}
        revoked, self._kept = self._kept, set()
        gone = revoked - assigned
        if gone:
            await self._give_up(gone, "went to another member")
        back = await self._kept_work(revoked & assigned)
        fresh = assigned - back
        starts: dict[TopicPartition, tuple[int, dict[int, int]]] = {}
        for tp in fresh:
            await self.delivery.partition_assigned(tp)
            starts[tp] = await self._start_position(tp)
        # No await from here on (see the module docstring, step 3).
        for tp in back:
            part = self.tracker.get(tp)
            assert part is not None
            part.revoking = False
            if part.next_expected is not None:
                self.consumer.seek(tp, part.next_expected)
        for tp, (start, _) in starts.items():
            self.consumer.seek(tp, start)
        epochs = self.tracker.assign(fresh)
        for tp, (start, counts) in starts.items():
            self.tracker.expect_from(tp, start)
            part = self.tracker.get(tp)
            assert part is not None
            part.attempts.load(counts)
            part.expected_commit = self._found.pop(tp, (None, ""))
        if self.stopping() and assigned:
            self.consumer.pause(*assigned)
        self.health.group_joined = True
        if back:
            self.wake_commit()  # the commit round after it lets their held jobs start
        self.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned),
                      kept=sorted(tp.partition for tp in back), given_up=sorted(tp.partition for tp in gone),
                      epochs=list(epochs.values()), start_offsets={tp.partition: o for tp, (o, _) in starts.items()},
                      crash_attempts={tp.partition: c for tp, (_, c) in starts.items() if c},
                      in_flight_kept=sum(self.tracker.in_flight(tp) for tp in back))

    async def _kept_work(self, candidates: set[TopicPartition]) -> set[TopicPartition]:
        """The partitions that came back whose work goes on (step 2 of the module docstring);
        the others are given up here."""
        if not candidates:
            return set()
        generation = generation_of(self.consumer)
        continuous = generation is not None and self._revoked_in is not None and generation == self._revoked_in + 1
        found = await self.retry(partial(read_committed_many, self.consumer, sorted(candidates)),
                                 "read the committed offsets")
        back = set()
        for tp in candidates:
            part = self.tracker.get(tp)
            if part is not None and found[tp] == part.expected_commit:
                back.add(tp)
                # A generation went by without this worker (a join round that did not complete, or
                # one it missed): whoever had the partition then answered nothing (the offset did not
                # move), but may have taken its transactional id. Exactly-once takes it back.
                await self.delivery.partition_returned(tp, reclaim=not continuous)
        moved = candidates - back
        if moved:
            self.log.warning("partitions came back changed (another member may have had them); their work is "
                             "given up", partitions=sorted(tp.partition for tp in moved), generation=generation,
                             revoked_in=self._revoked_in)
            await self._give_up(moved, "came back changed")
        return back

    async def _start_position(self, tp: TopicPartition) -> tuple[int, dict[int, int]]:
        """The committed offset and its crash attempt counts, or the beginning when nothing was
        committed."""
        committed, metadata = await self.retry(partial(read_committed, self.consumer, tp), "read the committed offset")
        self._found[tp] = (committed, metadata)
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
        if self.stopping():
            await self.done.settle(owned, self.settings.drain_timeout_s)
            abandoned = self.inflight.abandon_where(lambda job: job.fetched.tp in owned, "stopping")
            await self.delivery.commit(owned)
            await self._forget(owned)
            self.log.info("partitions revoked", partitions=sorted(tp.partition for tp in owned),
                          abandoned_in_flight=abandoned)
            return
        if self.settings.revoke_grace_s > 0:
            await self.done.settle(owned, self.settings.revoke_grace_s)
        await self.delivery.commit(owned, settled=True)
        self._kept |= owned
        self._revoked_in = generation_of(self.consumer)
        self.log.info("partitions revoked; their work is kept until the new assignment",
                      partitions=sorted(tp.partition for tp in owned),
                      in_flight=sum(self.tracker.in_flight(tp) for tp in owned), generation=self._revoked_in)

    async def _give_up(self, partitions: set[TopicPartition], why: str) -> None:
        """Abort the work of partitions that are no longer ours; nothing is committed for them."""
        aborted = self.inflight.abandon_where(lambda job: job.fetched.tp in partitions, "rebalance")
        self.log.info("partitions left this worker; their in-flight jobs are aborted",
                      partitions=sorted(tp.partition for tp in partitions), why=why, abandoned_in_flight=aborted)
        await self._forget(partitions)

    async def _forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            await self.delivery.partition_revoked(tp)
        self.forget(partitions)
        self.tracker.revoke(partitions)

    def lost(self, tp: TopicPartition) -> None:
        self.inflight.abandon_where(lambda job: job.fetched.tp == tp, "lost")
        self.tracker.revoke([tp])
