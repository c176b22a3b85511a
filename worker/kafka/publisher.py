"""Publishing Results, TokenEvents and dead letters with acknowledgement, surviving broker restarts.

One idempotent producer (acks=all) carries everything in at-least-once mode. A send is done only
when the broker acknowledged it. A failed send is classified (`refusal_of`):

- retriable (the broker away, a leader moving, a request timed out, the producer's buffer full
  because the broker is not taking records): retried here with backoff until it succeeds or the
  caller says the work is void (its partition was revoked, or the worker gives up at the end of
  a drain);
- refused for good: the record is too large for its topic (`too_large`), the worker may not
  write the topic (`denied`), or the broker calls the record invalid (`invalid`). Such a send is
  never tried again as it was. A record that says how to shrink itself (`OutRecord.shrink`: a
  Result is cut down, a dead letter's value cut, see sizing.py) is sent again smaller after a
  `too_large`; any other refusal raises `PublishRefused`, which stops the worker with the reason
  (its offsets stay uncommitted: nothing is lost, the jobs run again once it is fixed).

A refusal by the broker costs more than the record: aiokafka's idempotent producer keeps counting
a partition's sequence numbers past the refused batch, so every later batch of that partition is
refused as out of order (`OutOfOrderSequenceNumber`). `WorkerProducer` therefore sends a topic
whose records the broker refused (or found out of order) through a second, non-idempotent
producer from then on (acks=all still; no sequence to lose): a retry there may write a record
twice, which readers handle already (Results by job_id, TokenEvents by attempt and index).

TokenEvents of all jobs go through one ordered queue so each job's events are handed to the
producer in index order; a job's Result is sent only after all its events were acknowledged. A
TokenEvent larger than the tokens topic takes, or one the broker refuses for good, is dropped
(`on_dropped` counts and logs it): the stream then has a gap, the job's Result still goes out and
its offset still completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    PolicyViolationError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnknownError,
    UnsupportedForMessageFormatError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder

KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588  # a topic's max.message.bytes when nothing is set

# Why a record was refused for good (the `reason` label of the refusal and drop metrics).
TOO_LARGE = "too_large"
DENIED = "denied"
INVALID = "invalid"
_REFUSALS: tuple[tuple[tuple[type[KafkaError], ...], str], ...] = (
    ((MessageSizeTooLargeError, RecordListTooLargeError), TOO_LARGE),
    ((TopicAuthorizationFailedError, ClusterAuthorizationFailedError, TransactionalIdAuthorizationFailed), DENIED),
    # UnknownError: codes aiokafka does not know, INVALID_RECORD (87) among them.
    ((CorruptRecordException, InvalidTopicError, InvalidTimestampError, UnsupportedForMessageFormatError,
      PolicyViolationError, UnknownError), INVALID),
)


def refusal_of(exc: BaseException) -> str | None:
    """TOO_LARGE, DENIED or INVALID when the record was refused for good; None when a later try
    may succeed (every other Kafka error: the broker away, leaders moving, timeouts; an
    out-of-order sequence, which a try through the plain producer mends)."""
    for kinds, reason in _REFUSALS:
        if isinstance(exc, kinds):
            return reason
    return None


def _broker_lost_sequence(producer, topic: str, exc: BaseException | None = None) -> bool:
    """After the broker refused a batch of topic, or found it out of order: later records of that
    topic go through the plain producer. True if the producer can do that (a WorkerProducer)."""
    lost = getattr(producer, "lost_sequence", None)
    if lost is None:
        return False
    lost(topic, exc)
    return True


class WorkerProducer:
    """The idempotent producer, with a plain one for the topics the broker refused a record of.

    Offers what the worker uses of an AIOKafkaProducer (start, stop, send, partitions_for, client,
    which stays the idempotent one's)."""

    def __init__(self, main, make_plain: Callable[[], object],
                 on_switch: Callable[[str, BaseException | None], None] | None = None) -> None:
        self.main = main
        self._make_plain = make_plain
        self._plain = None
        self._plain_lock = asyncio.Lock()
        self.on_switch = on_switch  # (topic, error): a topic moved to the plain producer
        self.plain_topics: set[str] = set()

    @property
    def client(self):
        return self.main.client

    async def start(self) -> None:
        await self.main.start()

    async def stop(self) -> None:
        try:
            if self._plain is not None:
                await self._plain.stop()
        finally:
            await self.main.stop()

    async def partitions_for(self, topic: str):
        return await self.main.partitions_for(topic)

    def lost_sequence(self, topic: str, exc: BaseException | None = None) -> None:
        if topic not in self.plain_topics:
            self.plain_topics.add(topic)
            if self.on_switch:
                self.on_switch(topic, exc)

    async def send(self, topic, value=None, key=None, partition=None, timestamp_ms=None, headers=None):
        producer = self.main
        if topic in self.plain_topics:
            async with self._plain_lock:
                if self._plain is None:
                    plain = self._make_plain()
                    await plain.start()
                    self._plain = plain
            producer = self._plain
        return await producer.send(topic, value=value, key=key, partition=partition, timestamp_ms=timestamp_ms,
                                   headers=headers)


def record_size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None) -> int:
    """An upper bound on the size of a record batch holding just this record."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))


@dataclass
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    partition: int | None = None
    # Given the size the broker refused, a smaller record that answers the same input (or None
    # when there is none); see sizing.py. None: the record cannot be cut.
    shrink: Callable[[int], OutRecord | None] | None = field(default=None, repr=False, compare=False)
    cut: str | None = None  # how it was cut down to fit its topic (sizing.py), None when whole

    def size(self) -> int:
        return record_size(self.key, self.value, self.headers)


# The acknowledgement futures of one job's TokenEvents, with what is needed to send one again.
TokenSink = list[tuple["asyncio.Future[object]", bytes, str]]  # (ack future, payload, job_id)


class PublishAbandoned(Exception):
    """The record was not sent because the work it belongs to is void."""


class PublishRefused(Exception):
    """The broker refused a record for good and it cannot be cut down: the worker must stop."""

    def __init__(self, topic: str, reason: str, error: BaseException) -> None:
        hint = {DENIED: "check the worker's ACLs on that topic", TOO_LARGE: "raise the topic's max.message.bytes",
                INVALID: "check the topic's settings (cleanup.policy, message.timestamp.*, policies)"}[reason]
        super().__init__(f"the broker refused a record for topic {topic} ({reason}: {error!r}); {hint}")
        self.topic = topic
        self.reason = reason


async def send_acked(
    producer,
    rec: OutRecord,
    *,
    still_wanted: Callable[[], bool] = lambda: True,
    on_retry: Callable[[BaseException, int], None] | None = None,
    max_backoff_s: float = 5.0,
) -> None:
    """Send one record and wait for the broker's acknowledgement: retriable Kafka errors are tried
    again with backoff; a `too_large` refusal sends the record's smaller replacement; any other
    refusal raises PublishRefused."""
    attempt = 0
    while True:
        if not still_wanted():
            raise PublishAbandoned(rec.topic)
        sent = False  # past the producer's own checks: a failure now is the broker's answer
        try:
            fut = await producer.send(
                rec.topic, value=rec.value, key=rec.key, headers=rec.headers, partition=rec.partition
            )
            sent = True
            await fut
            return
        except KafkaError as exc:
            attempt += 1
            if on_retry:
                on_retry(exc, attempt)
            reason = refusal_of(exc)
            if isinstance(exc, OutOfOrderSequenceNumber) and _broker_lost_sequence(producer, rec.topic, exc):
                continue  # at once, through the plain producer
            if sent and reason is not None:
                _broker_lost_sequence(producer, rec.topic, exc)
            if reason is None:
                await asyncio.sleep(min(max_backoff_s, 0.1 * 2**attempt))
                continue
            size = rec.size()
            smaller = rec.shrink(size) if reason == TOO_LARGE and rec.shrink is not None else None
            if smaller is None or smaller.size() >= size:
                raise PublishRefused(rec.topic, reason, exc) from exc
            rec, attempt = smaller, 0


class TokenStream:
    """Ordered, acknowledged delivery of TokenEvents; one instance per worker."""

    def __init__(self, producer, topic: str, on_retry=None, max_bytes: int = KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
                 on_dropped: Callable[[str, str, BaseException | None], None] | None = None) -> None:
        self._producer = producer
        self._topic = topic
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_retry = on_retry
        self._max_bytes = max_bytes  # the tokens topic's max.message.bytes
        self._on_dropped = on_dropped  # (job_id, reason, error): an event left out of the stream
        self._task: asyncio.Task | None = None
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="token-stream")

    def publish(self, job_id: str, payload: bytes, sink: TokenSink) -> bool:
        """Queue one event; its ack future is appended to `sink` once handed to the producer.
        False: the event is larger than the topic takes and was left out (not queued)."""
        if record_size(job_id.encode(), payload) > self._max_bytes:
            self._drop(job_id, TOO_LARGE, None)
            return False
        self._queue.put_nowait((job_id, payload, sink))
        return True

    def enqueued(self) -> asyncio.Future:
        """A future done once everything queued so far has been handed to the producer."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((None, None, fut))
        return fut

    def _drop(self, job_id: str, reason: str, error: BaseException | None, size: int = 0) -> None:
        self.dropped += 1
        if reason == TOO_LARGE and size:  # the topic takes less than we knew: check before sending
            self._max_bytes = min(self._max_bytes, size - 1)
        if self._on_dropped:
            self._on_dropped(job_id, reason, error)

    async def _run(self) -> None:
        while True:
            job_id, payload, sink = await self._queue.get()
            if job_id is None:
                if not sink.done():
                    sink.set_result(None)
                continue
            while True:
                try:
                    fut = await self._producer.send(self._topic, value=payload, key=job_id.encode())
                    sink.append((fut, payload, job_id))
                    break
                except KafkaError as exc:
                    reason = refusal_of(exc)
                    if reason is not None:  # the producer's own check (the broker never saw it)
                        self._drop(job_id, reason, exc, record_size(job_id.encode(), payload))
                        break
                    if self._on_retry:
                        self._on_retry(exc, 1)
                    await asyncio.sleep(0.5)

    async def confirm(self, sink: TokenSink, still_wanted: Callable[[], bool] = lambda: True) -> None:
        """Wait for every event in `sink` to be acknowledged, re-sending (in order) the failed ones;
        an event refused for good is dropped."""
        await self.enqueued()
        for fut, payload, job_id in list(sink):
            try:
                await fut
            except KafkaError as exc:
                reason = refusal_of(exc)
                if reason is not None:  # the broker's refusal
                    _broker_lost_sequence(self._producer, self._topic, exc)
                    self._drop(job_id, reason, exc, record_size(job_id.encode(), payload))
                    continue
                if isinstance(exc, OutOfOrderSequenceNumber):
                    _broker_lost_sequence(self._producer, self._topic, exc)
                rec = OutRecord(self._topic, job_id.encode(), payload)
                try:
                    await send_acked(self._producer, rec, still_wanted=still_wanted, on_retry=self._on_retry)
                except PublishRefused as refused:
                    self._drop(job_id, refused.reason, refused.__cause__, rec.size())

    async def stop(self) -> None:
        if self._task:
            await self.enqueued()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
