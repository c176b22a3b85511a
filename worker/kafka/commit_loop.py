"""The commit task: every --commit-interval, commit each partition's watermark, then report lag.

The commit point of a partition is the lowest offset not yet answered (or one past the highest
fetched, when all are answered; offsets.py). How it is committed belongs to the delivery mode
(delivery.py: the consumer group's offset commit, or one transaction per partition); this loop
only says when, and leaves partitions in a revoke grace to the rebalance, which commits them
itself before letting them go. A commit that fails (the broker is away) is tried again on the
next tick.

The loop is also woken at once (`wake`) when jobs wait to start: their crash attempts must be
in a committed offset's metadata before they enter the engine (starts.py). After every commit
round, `on_committed` hands those jobs on. Lag is reported on the interval only.

`tokenmill_commit_lag{topic,partition}` is the number of records between the committed offset
(the commit point, before the first commit) and the partition's end; a revoked partition's
series is removed, so a dashboard shows only what this worker owns.
"""

from __future__ import annotations

import asyncio
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
            await self.delivery.commit([tp for tp in owned if not self._revoking(tp)])
            self.on_committed()
            if tick:
                self.update_lag()

    def _revoking(self, tp: TopicPartition) -> bool:
        part = self.tracker.get(tp)
        return part is None or part.revoking

    def update_lag(self) -> None:
        for tp in self.tracker.partitions():
            part = self.tracker.get(tp)
            high = self.consumer.highwater(tp)
            if part is None or high is None:
                continue
            committed = part.last_committed if part.last_committed is not None else part.commit_point()
            if committed is None:
                continue
            label = (tp.topic, str(tp.partition))
            self.metrics.commit_lag.labels(*label).set(max(0, high - committed))
            self._lag_labels.add(label)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Remove the lag series of partitions this worker no longer owns."""
        for tp in partitions:
            label = (tp.topic, str(tp.partition))
            if label in self._lag_labels:
                self.metrics.commit_lag.remove(*label)
                self._lag_labels.discard(label)
