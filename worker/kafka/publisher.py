"""Publishing Results, TokenEvents and dead letters with acknowledgement, surviving broker restarts.

One idempotent producer (acks=all) carries everything in at-least-once mode. A send is done only
when the broker acknowledged it; a failed send (broker away longer than the producer's own
retries) is retried here with backoff until it succeeds or the caller says the work is void
(its partition was revoked, or the worker gives up at the end of a drain).

TokenEvents of all jobs go through one ordered queue so each job's events are handed to the
producer in index order; a job's Result is sent only after all its events were acknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.errors import KafkaError


@dataclass
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    partition: int | None = None


# The acknowledgement futures of one job's TokenEvents, with what is needed to send one again.
TokenSink = list[tuple["asyncio.Future[object]", bytes, str]]  # (ack future, payload, job_id)


class PublishAbandoned(Exception):
    """The record was not sent because the work it belongs to is void."""


async def send_acked(
    producer,
    rec: OutRecord,
    *,
    still_wanted: Callable[[], bool] = lambda: True,
    on_retry: Callable[[BaseException, int], None] | None = None,
    max_backoff_s: float = 5.0,
) -> None:
    """Send one record and wait for the broker's acknowledgement, retrying on Kafka errors."""
    attempt = 0
    while True:
        if not still_wanted():
            raise PublishAbandoned(rec.topic)
        try:
            fut = await producer.send(
                rec.topic, value=rec.value, key=rec.key, headers=rec.headers, partition=rec.partition
            )
            await fut
            return
        except KafkaError as exc:
            attempt += 1
            if on_retry:
                on_retry(exc, attempt)
            await asyncio.sleep(min(max_backoff_s, 0.1 * 2**attempt))


class TokenStream:
    """Ordered, acknowledged delivery of TokenEvents; one instance per worker."""

    def __init__(self, producer, topic: str, on_retry=None) -> None:
        self._producer = producer
        self._topic = topic
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_retry = on_retry
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="token-stream")

    def publish(self, job_id: str, payload: bytes, sink: TokenSink) -> None:
        """Queue one event; its ack future is appended to `sink` once handed to the producer."""
        self._queue.put_nowait((job_id, payload, sink))

    def enqueued(self) -> asyncio.Future:
        """A future done once everything queued so far has been handed to the producer."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((None, None, fut))
        return fut

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
                    if self._on_retry:
                        self._on_retry(exc, 1)
                    await asyncio.sleep(0.5)

    async def confirm(self, sink: TokenSink, still_wanted: Callable[[], bool] = lambda: True) -> None:
        """Wait for every event in `sink` to be acknowledged, re-sending (in order) the failed ones."""
        await self.enqueued()
        for fut, payload, job_id in list(sink):
            try:
                await fut
            except KafkaError:
                await send_acked(
                    self._producer,
                    OutRecord(self._topic, job_id.encode(), payload),
                    still_wanted=still_wanted,
                    on_retry=self._on_retry,
                )

    async def stop(self) -> None:
        if self._task:
            await self.enqueued()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
