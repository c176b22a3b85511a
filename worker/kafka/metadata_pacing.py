"""Metadata refreshes paced while no broker answers, so an outage costs no CPU.

aiokafka (0.14) refreshes cluster metadata in one background task that anybody can wake with
`force_metadata_update()`. While a broker is away, a refused connection fails that refresh at once,
and whoever woke it wakes it again at once: the producer's sender does so in a loop without a pause
whenever a partition's leader is unknown (which is how a broker that is shutting down leaves its
partitions). A worker whose broker went away with answers waiting to be sent then spins one core
and writes two error lines per turn, some 2,500 a second (37 MB of log in a two-minute outage).

The Java client does not: it spaces metadata requests by `retry.backoff.ms`, growing to
`retry.backoff.max.ms` (KIP-580). `pace_metadata_refreshes` gives an aiokafka client the same rule:
after a failed refresh it waits before reporting the failure, 0.1 s doubling to 1 s (each wait
within 20% of that, so clients of one fleet do not retry in step); a refresh that succeeds starts
over at 0.1 s. A broker that comes back is therefore seen within about a second.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

FIRST_BACKOFF_S = 0.1  # Kafka's retry.backoff.ms
MAX_BACKOFF_S = 1.0  # Kafka's retry.backoff.max.ms
JITTER = 0.2


def pace_metadata_refreshes(kafka_client: Any, first_s: float = FIRST_BACKOFF_S, max_s: float = MAX_BACKOFF_S):
    """Make kafka_client (an AIOKafkaClient: a producer's `.client`, a consumer's `._client`) wait
    after each failed metadata refresh before the next can start; returns the client. Safe to
    apply twice (the second call changes nothing)."""
    if getattr(kafka_client, "_tokenmill_paced", False):
        return kafka_client
    refresh = kafka_client._metadata_update
    failures = 0

    async def paced_refresh(cluster_metadata, topics):
        nonlocal failures
        ok = await refresh(cluster_metadata, topics)
        if ok:
            failures = 0
        else:
            wait = min(max_s, first_s * 2 ** failures)
            failures += 1
            await asyncio.sleep(wait * random.uniform(1 - JITTER, 1 + JITTER))
        return ok

    kafka_client._metadata_update = paced_refresh
    kafka_client._tokenmill_paced = True
    return kafka_client


def client_of(owner) -> Any:
    """The AIOKafkaClient of an aiokafka producer (`.client`) or consumer (`._client`)."""
    client = getattr(owner, "client", None)
    return owner._client if client is None else client


def paced(owner):
    """An aiokafka producer or consumer whose client paces its metadata refreshes; returns owner."""
    pace_metadata_refreshes(client_of(owner))
    return owner
