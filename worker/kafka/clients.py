"""The worker's aiokafka clients, configured from its settings.

- the consumer: a group member with manual commits, `read_committed` (so the jobs topic may be
  written transactionally), starting from the beginning when the group committed nothing;
- the producer: idempotent, acks=all, a short linger, for TokenEvents and at-least-once answers;
- exactly-once: one transactional producer per input partition (transactions.py).

The security settings (SSL, SASL) apply to every one of them.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from structlog.typing import FilteringBoundLogger

from worker.config import WorkerSettings


def _client_kwargs(s: WorkerSettings) -> dict[str, Any]:
    return dict(bootstrap_servers=s.bootstrap_servers, **s.security.aiokafka_kwargs())


def _producer_kwargs(s: WorkerSettings) -> dict[str, Any]:
    return dict(acks="all", enable_idempotence=True, request_timeout_ms=30_000, linger_ms=2,
                max_batch_size=256 * 1024, **_client_kwargs(s))


def new_producer(s: WorkerSettings) -> AIOKafkaProducer:
    return AIOKafkaProducer(**_producer_kwargs(s))


def new_transactional_producer(s: WorkerSettings, txn_id: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(transactional_id=txn_id, transaction_timeout_ms=60_000, **_producer_kwargs(s))


def new_consumer(s: WorkerSettings) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
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
    )


async def partition_count(producer: AIOKafkaProducer, topic: str, log: FilteringBoundLogger) -> int:
    """How many partitions topic has; 0 when that cannot be read."""
    try:
        parts = await producer.partitions_for(topic)
    except KafkaError as exc:
        log.warning("cannot read the partitions of a topic", topic=topic, error=repr(exc))
        return 0
    return len(parts) if parts else 0
