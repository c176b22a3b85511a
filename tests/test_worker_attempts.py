"""Crash attempts of in-process workers against the real broker: a job's attempt is in the
committed offset's metadata while it runs, and a graceful end (a drain, a revoke) gives it back.
(The job that kills its worker each time is in test_worker_crash.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.worker_helpers import job, make_topics, produce, running_worker, wait_for, worker_settings
from tokenmill.kafka.attempts import read_committed

pytestmark = [pytest.mark.kafka]


def _slow_engine(model_dir, step_s: float = 0.02):
    """A tiny engine whose steps take at least step_s: long jobs stay in flight for a while."""
    from tokenmill.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=16, max_num_batched_tokens=512,
                                 kv_cache_gb=0.05))
    real_step = engine.step

    def step():
        time.sleep(step_s)
        return real_step()

    engine.step = step
    return engine


async def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, tuple[int | None, str]]:
    """Each partition's committed offset and metadata, read outside the group (no join)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return {p: await read_committed(consumer, TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        await consumer.stop()


async def test_running_jobs_are_counted_on_the_broker_and_a_drain_gives_their_attempts_back(
        kafka_bootstrap, tiny_llama_dir):
    topics = await make_topics(kafka_bootstrap, "attempts-drain", partitions=1)
    await produce(kafka_bootstrap, topics.jobs, [job(i, max_tokens=1000) for i in range(4)])
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, drain_timeout_s=0.0)
    async with running_worker(settings, _slow_engine(tiny_llama_dir)) as (w, task):
        # Written ahead: all four are counted once (offsets 0-3, one run) while they run.
        seen = await _wait_metadata(kafka_bootstrap, topics, {0: (0, "tm1:0+4")})
        assert w.engine.stats().running == 4 and w.answered == 0, seen
    assert task.result() == 0
    # The drain (timeout 0) aborted them: not a crash, the commit carries no attempts.
    assert await _committed(kafka_bootstrap, topics.group, topics.jobs, 1) == {0: (0, "")}


async def _wait_metadata(bootstrap, topics, want: dict[int, tuple[int, str]], timeout: float = 30) -> dict:
    seen: dict = {}

    async def matches() -> bool:
        seen.update(await _committed(bootstrap, topics.group, topics.jobs, len(want)))
        return seen == want

    try:
        await wait_for(matches, timeout, interval=0.2, what=f"committed {want}")
    except TimeoutError as exc:
        raise AssertionError(f"committed offsets and metadata {seen}, wanted {want}") from exc
    return seen


async def test_a_revoke_gives_the_attempts_back_so_the_next_owner_counts_from_where_they_were(
        kafka_bootstrap, tiny_llama_dir):
    topics = await make_topics(kafka_bootstrap, "attempts-revoke", partitions=2)
    jobs = [job(i, max_tokens=1000) for i in range(8)]
    await produce(kafka_bootstrap, topics.jobs, jobs[:4], partition=0)
    await produce(kafka_bootstrap, topics.jobs, jobs[4:], partition=1)
    running = {0: (0, "tm1:0+4"), 1: (0, "tm1:0+4")}
    a = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, drain_timeout_s=0.0, worker_name="a")
    b = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, drain_timeout_s=0.0, worker_name="b")
    async with running_worker(a, _slow_engine(tiny_llama_dir)) as (wa, _):
        await _wait_metadata(kafka_bootstrap, topics, running)
        async with running_worker(b, _slow_engine(tiny_llama_dir)) as (wb, _):
            # Eager rebalance: a lets both partitions go (grace 1 s; the jobs are far from done),
            # each worker takes one and starts its four jobs again. Had the revoke not given the
            # attempts back, they would now be counted twice ("tm1:0+4x2").
            await wait_for(lambda: len(wa.tracker.partitions()) == 1 == len(wb.tracker.partitions()), 30,
                           what="one partition each")
            await wait_for(lambda: wa.engine.stats().running == 4 == wb.engine.stats().running, 30,
                           what="four jobs running in each worker")
            await asyncio.sleep(0.5)  # the write-ahead commits of the new owners are done
            assert await _committed(kafka_bootstrap, topics.group, topics.jobs, 2) == running
            assert wa.starts.solo_runs == 0 == wb.starts.solo_runs
