"""Metadata refreshes paced while no broker answers (worker/kafka/metadata_pacing.py).

The clients here are aiokafka's own, pointed at a port where nothing listens, so every refresh
fails at once with a refused connection, as it does while a broker is away. The loop that wakes
the refresh again as soon as it failed is the one aiokafka's sender runs while a partition's
leader is unknown. The end-to-end check is the two-minute outage (test_worker_outage.py), whose
worker log is held to a few lines of failed refreshes a second.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.client import AIOKafkaClient

from tokenmill.kafka.local_broker import free_port
from tokenmill.kafka.metadata_pacing import (
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    client_of,
    pace_metadata_refreshes,
    paced,
)


async def _refreshes_in(client: AIOKafkaClient, seconds: float) -> list[float]:
    """Wake the client's refresh again each time it reports, for `seconds`; the times refreshes began."""
    began: list[float] = []
    inner = client._metadata_update

    async def counted(cluster, topics):
        began.append(time.monotonic())
        return await inner(cluster, topics)

    client._metadata_update = counted
    client._sync_task = asyncio.get_running_loop().create_task(client._md_synchronizer())
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await asyncio.wait([client.force_metadata_update()], timeout=deadline - time.monotonic())
    finally:
        await client.close()
    return began


def _unreachable_client() -> AIOKafkaClient:
    return AIOKafkaClient(bootstrap_servers=f"127.0.0.1:{free_port()}", retry_backoff_ms=100)


async def test_without_pacing_a_failed_refresh_is_tried_again_at_once():
    """Why the pacing exists: aiokafka itself waits for nothing between failed refreshes. If this
    fails, aiokafka learned to wait, and metadata_pacing.py can go."""
    began = await _refreshes_in(_unreachable_client(), 0.5)
    assert len(began) > 200, len(began)


async def test_a_paced_client_waits_longer_after_each_failed_refresh_up_to_a_second():
    client = pace_metadata_refreshes(_unreachable_client())
    cpu0 = time.process_time()
    began = await _refreshes_in(client, 3.5)
    cpu = time.process_time() - cpu0
    gaps = [b - a for a, b in zip(began, began[1:], strict=False)]
    # 0.1, 0.2, 0.4, 0.8, 1, 1 s (each within 20%): 6 or 7 refreshes in 3.5 s, not thousands.
    assert 5 <= len(began) <= 8, gaps
    assert gaps[0] == pytest.approx(FIRST_BACKOFF_S, rel=0.5)
    assert all(b > a for a, b in zip(gaps[:3], gaps[1:4], strict=False)), gaps
    assert max(gaps) <= MAX_BACKOFF_S * 1.2 + 0.1, gaps
    assert cpu < 0.5, cpu


class _ScriptedClient:
    """Stands in for a client's refresh only: each call returns the next scripted outcome."""

    def __init__(self, outcomes: list[bool]):
        self.outcomes = outcomes

    async def _metadata_update(self, cluster, topics):
        return self.outcomes.pop(0)


async def test_a_refresh_that_succeeds_starts_the_waits_over_and_returns_at_once():
    client = pace_metadata_refreshes(_ScriptedClient([False, False, False, True, False, True]), first_s=0.05)
    waits = []
    for expected in (False, False, False, True, False, True):
        t0 = time.monotonic()
        assert await client._metadata_update(None, None) is expected
        waits.append(time.monotonic() - t0)
    assert waits[0] == pytest.approx(0.05, rel=0.4) and waits[2] == pytest.approx(0.2, rel=0.4)
    assert waits[3] < 0.02 and waits[5] < 0.02  # a success is reported at once
    assert waits[4] == pytest.approx(0.05, rel=0.4)  # and the next failure waits the first wait again


async def test_pacing_twice_paces_once():
    client = _ScriptedClient([False])
    once = pace_metadata_refreshes(client, first_s=0.05)._metadata_update
    assert pace_metadata_refreshes(client)._metadata_update is once


async def test_every_client_the_worker_makes_is_paced():
    from tokenmill.config import WorkerSettings
    from tokenmill.engine.config import EngineConfig
    from tokenmill.kafka import clients

    s = WorkerSettings(bootstrap_servers=f"127.0.0.1:{free_port()}", engine=EngineConfig(model="m"))
    producer = clients.new_producer(s)
    made = [producer.main, producer._make_plain(), clients.new_transactional_producer(s, "txn-1"),
            clients.new_consumer(s)]
    for owner in made:
        assert client_of(owner)._tokenmill_paced, owner
    assert paced(made[0]) is made[0]
