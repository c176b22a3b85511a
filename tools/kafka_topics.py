"""Partition discovery for readers that assign partitions themselves (tail, backfill, demo)."""

from __future__ import annotations


async def topic_partitions(consumer, topic: str) -> list[int]:
    """The partition ids of `topic`, fetched fresh from the cluster; ValueError if it does not exist,
    KafkaAccessDenied (worker/kafka/security.py) if this principal may not describe it.

    aiokafka's public `topics()` fetches the metadata but does not keep it, and
    `partitions_for_topic()` only answers from metadata the client already holds (None for a topic
    it was never subscribed to), so the fetched cluster view is read directly.
    """
    cluster = await consumer._client.fetch_all_metadata()
    parts = cluster.partitions_for_topic(topic)
    if not parts:
        # A topic this principal may not describe is left out of the list, as if it did not exist.
        from tokenmill.kafka.security import check_topic_access

        await check_topic_access(consumer._client, {topic: "READ"})
        raise ValueError(f"topic {topic!r} does not exist (create it first; see deploy/TOPICS.md)")
    return sorted(parts)
