"""The worker's aiokafka clients, configured from its settings.

- the consumer: a group member with manual commits, `read_committed` (so the jobs topic may be
  written transactionally), starting from the beginning when the group committed nothing, and
  the sticky assignor (partitions stay where they were across rebalances);
- the producer: idempotent, acks=all, a short linger, for TokenEvents and at-least-once answers;
- exactly-once: one transactional producer per input partition (transactions.py);
- every client paces its metadata refreshes while no broker answers (metadata_pacing.py);
- the producers' request and batch sizes follow the output topics' `max.message.bytes`, read
  once at start (`read_topic_limits`; sizing.py says why and how).

The security settings (SSL, SASL) apply to every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.errors import KafkaError
from structlog.typing import FilteringBoundLogger

from tokenmill.config import WorkerSettings
from tokenmill.kafka.metadata_pacing import paced
from tokenmill.kafka.publisher import WorkerProducer
from tokenmill.kafka.sizing import TopicLimits


def _client_kwargs(s: WorkerSettings) -> dict[str, Any]:
    return dict(bootstrap_servers=s.bootstrap_servers, **s.security.aiokafka_kwargs())


def _producer_kwargs(s: WorkerSettings, limits: TopicLimits | None) -> dict[str, Any]:
    sizes = (limits or TopicLimits()).producer_kwargs()  # max_request_size, max_batch_size
    return dict(acks="all", enable_idempotence=True, request_timeout_ms=30_000, linger_ms=2, **sizes,
                **_client_kwargs(s))


def new_producer(s: WorkerSettings, limits: TopicLimits | None = None,
                 on_switch: Callable[[str, BaseException | None], None] | None = None) -> WorkerProducer:
    """The idempotent producer, with its plain stand-in for topics the broker refused a record of
    (publisher.py says why); on_switch(topic, error) is told when a topic moves over."""
    kwargs = _producer_kwargs(s, limits)
    plain = dict(kwargs, enable_idempotence=False)
    return WorkerProducer(paced(AIOKafkaProducer(**kwargs)), lambda: paced(AIOKafkaProducer(**plain)), on_switch)


def new_transactional_producer(s: WorkerSettings, txn_id: str, limits: TopicLimits | None = None) -> AIOKafkaProducer:
    return paced(AIOKafkaProducer(transactional_id=txn_id, transaction_timeout_ms=60_000, **_producer_kwargs(s, limits)))


async def read_topic_limits(s: WorkerSettings, log: FilteringBoundLogger) -> TopicLimits:
    """max.message.bytes of the results, tokens and dead-letter topics; Kafka's default for a
    topic whose config cannot be read (logged). Raises KafkaConnectionError while no broker
    answers (the start waits for one)."""
    from tokenmill.kafka.admin import topic_config_values

    topics = (s.results_topic, s.tokens_topic, s.dlq_topic)
    values = await topic_config_values(s.bootstrap_servers, topics, "max.message.bytes",
                                       client_options=s.security.aiokafka_kwargs())
    limits = TopicLimits({t: int(v) for t, v in values.items() if v is not None and v.isdigit()},
                         tuple(t for t, v in values.items() if v is None or not v.isdigit()))
    if limits.unread:
        log.warning("cannot read max.message.bytes of topics; assuming Kafka's default", topics=list(limits.unread))
    return limits


def sticky_assignor() -> type[AbstractPartitionAssignor]:
    """aiokafka's sticky assignor (KIP-54) for one consumer. It keeps the member's last assignment
    in class attributes, which every consumer of the process would share; a subclass of its own
    per consumer keeps them apart (tests run several workers in one process)."""
    return type("StickyAssignor", (StickyPartitionAssignor,), {"member_assignment": None, "generation": -1})


def new_consumer(s: WorkerSettings) -> AIOKafkaConsumer:
    # Sticky: partitions stay with their member across rebalances, so their work goes on
    # (rebalance.py). Only one strategy: aiokafka 0.14 sends one JoinGroup per strategy offered,
    # each with different metadata, which starts the next rebalance at once (the group never
    # settles). So a group cannot mix workers of this version with older, round-robin ones.
    return paced(AIOKafkaConsumer(
        partition_assignment_strategy=(sticky_assignor(),),
        group_id=s.group_id,
        group_instance_id=s.instance_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        session_timeout_ms=s.session_timeout_ms,
        heartbeat_interval_ms=s.heartbeat_interval_ms,
        max_poll_interval_ms=s.max_poll_interval_ms,
        rebalance_timeout_ms=s.max_poll_interval_ms,
        max_partition_fetch_bytes=1 << 20,
        **_client_kwargs(s),
    ))


async def partition_count(producer: AIOKafkaProducer | WorkerProducer, topic: str, log: FilteringBoundLogger) -> int:
    """How many partitions topic has; 0 when that cannot be read."""
    try:
        parts = await producer.partitions_for(topic)
    except KafkaError as exc:
        log.warning("cannot read the partitions of a topic", topic=topic, error=repr(exc))
        return 0
    return len(parts) if parts else 0
