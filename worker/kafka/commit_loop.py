"""The commit task: every --commit-interval, commit each partition's watermark, then report lag.

The commit point of a partition is the lowest offset not yet answered (or one past the highest
fetched, when all are answered; offsets.py). How it is committed belongs to the delivery mode
(delivery.py: the consumer group's offset commit, or one transaction per partition); this loop
only says when, and leaves revoked partitions to the rebalance, which commits them itself at the
revoke and leaves them alone until the new assignment says whether they stay. A commit that
fails (the broker is away) is tried again on the next tick.

The loop is also woken at once (`wake`) when jobs wait to start: their crash attempts must be
in a committed offset's metadata before they enter the engine (starts.py). After every commit
round, `on_committed` hands those jobs on. Lag is reported on the interval only.

`tokenmill_commit_lag{topic,partition}` is the number of records between the committed offset
(the commit point, before the first commit) and the partition's end, and
`tokenmill_oldest_unfinished_job_age_seconds{topic,partition}` the age of the oldest record taken
and not answered (now minus its timestamp; 0 when everything taken is answered): lag as a count
and lag in time. A revoked partition's series are removed, so a dashboard shows only what this
worker owns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from structlog.typing import FilteringBoundLogger

from tokenmill.aio import wait_event
from tokenmill.kafka.delivery import Delivery
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.metrics import WorkerMetrics


@dataclass(eq=False)
class CommitLoop:
    interval_s: float
    tracker: OffsetTracker[TopicPartition]
    delivery: Delivery  # how a partition's watermark is committed
    consumer: AIOKafkaConsumer  # for each partition's end (the high-water mark)
    metrics: WorkerMetrics
    log: FilteringBoundLogger
    describe_fetch: Callable[[], dict]  # for the debug line of each tick
    on_committed: Callable[[], None] = lambda: None  # after each commit round (starts.py)
    _lag_labels: set[tuple[str, str]] = field(default_factory=set, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def wake(self) -> None:
        """Commit now, not at the next tick."""
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time() + self.interval_s
        while True:
            left = next_tick - loop.time()
            if left > 0 and not self._wake.is_set():
                await wait_event(self._wake, left)
            self._wake.clear()
            tick = loop.time() >= next_tick
            owned = self.tracker.partitions()
            if tick:
                next_tick = loop.time() + self.interval_s
                self.log.debug("commit tick", partitions=[tp.partition for tp in owned],
                               in_flight=self.tracker.in_flight(), **self.describe_fetch())
            await self.delivery.commit(self.tracker.committable())
            self.on_committed()
            if tick:
                self.update_lag()

    def update_lag(self, now_ms: float | None = None) -> None:
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        for tp in self.tracker.partitions():
            part = self.tracker.get(tp)
            if part is None:
                continue
            label = (tp.topic, str(tp.partition))
            oldest = part.oldest_pending_timestamp_ms()
            self.metrics.oldest_job_age.labels(*label).set(0.0 if oldest is None else max(0.0, (now_ms - oldest) / 1000))
            self._lag_labels.add(label)
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            committed = part.last_committed if part.last_committed is not None else part.commit_point()
            if committed is None:
                continue
            self.metrics.commit_lag.labels(*label).set(max(0, high - committed))

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Remove the lag series of partitions this worker no longer owns."""
        for tp in partitions:
            label = (tp.topic, str(tp.partition))
            if label in self._lag_labels:
                for gauge in (self.metrics.commit_lag, self.metrics.oldest_job_age):
                    try:
                        gauge.remove(*label)
                    except KeyError:
                        pass
                self._lag_labels.discard(label)
