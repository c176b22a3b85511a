"""A worker that joins while the group is slow to settle: connecting is not joining.

An incumbent member of the group takes longer to give its partitions up than one connection try
of the new worker (15 s). Before, the worker took the slow join for an unreachable broker, called
the consumer's start() a second time and died with exit 1. Now it connects, says it is joining
(in its log and in /readyz), joins once the incumbent is done, answers jobs and drains on SIGTERM
with exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener

from tests.worker_helpers import (
    job,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    start_worker_process,
    stop_process,
    worker_command,
)

REVOKE_S = 22.0  # longer than a connection try (retry.BrokerWait.try_timeout_s = 15 s)


class SlowToLetGo(ConsumerRebalanceListener):
    """An incumbent whose revocation takes REVOKE_S (a long revoke grace, a slow commit)."""

    def __init__(self) -> None:
        self.revoking_since: float | None = None
        self.revoked_after: float | None = None
        self.assignments: list[set] = []

    async def on_partitions_revoked(self, revoked) -> None:
        if not self.assignments:  # nothing held yet: the first join
            return
        self.revoking_since = time.monotonic()
        await asyncio.sleep(REVOKE_S)
        self.revoked_after = time.monotonic() - self.revoking_since

    async def on_partitions_assigned(self, assigned) -> None:
        self.assignments.append(set(assigned))


def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _events(path, event: str) -> list[dict]:
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines()
            if f'"event": "{event}"' in line]


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_worker_joining_a_group_slower_than_one_try_joins_answers_and_exits_0(
        kafka_bootstrap, tiny_llama_dir, tmp_path):
    from tokenmill.kafka.clients import sticky_assignor
    from tokenmill.kafka.local_broker import free_port

    topics = await make_topics(kafka_bootstrap, "slow-join", partitions=4)
    listener = SlowToLetGo()
    incumbent = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=topics.group, enable_auto_commit=False,
                                 session_timeout_ms=10_000, heartbeat_interval_ms=1_000,
                                 rebalance_timeout_ms=60_000, max_poll_interval_ms=60_000,
                                 # the worker's own assignor: a member offering no strategy in common
                                 # with the group's is refused (INCONSISTENT_GROUP_PROTOCOL)
                                 partition_assignment_strategy=(sticky_assignor(),))
    await incumbent.start()
    incumbent.subscribe([topics.jobs], listener=listener)

    async def keep_polling() -> None:  # a live member: it polls, so the rebalance reaches its listener
        while True:
            await incumbent.getmany(timeout_ms=200)

    polling = asyncio.create_task(keep_polling())
    port, log = free_port(), tmp_path / "w.log"
    proc = None
    try:
        deadline = time.monotonic() + 60
        while not listener.assignments:
            assert time.monotonic() < deadline, "the incumbent never joined"
            await asyncio.sleep(0.1)
        proc = start_worker_process(worker_command(kafka_bootstrap, topics, tiny_llama_dir, "--metrics-port",
                                                   str(port), "--log-level", "INFO"), log)
        # While the incumbent holds on, the worker is connected and joining: alive, not ready, saying why.
        # The worker first builds its engine (on a fresh machine with the C kernels compiled first, on a
        # loaded one slowly: minutes), then joins, and the incumbent takes REVOKE_S to let go.
        saw_joining = False
        deadline = time.monotonic() + 300
        while listener.revoked_after is None:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            if listener.revoking_since is None:
                assert time.monotonic() < deadline, "the incumbent was never asked to revoke"
            else:
                assert time.monotonic() < listener.revoking_since + REVOKE_S + 30, "the revoke never ended"
            status, body = await asyncio.to_thread(_readyz, port)
            saw_joining |= status == 503 and body.startswith("joining the consumer group")
            await asyncio.sleep(0.5)
        assert saw_joining, "/readyz never said the worker was joining"
        # The incumbent leaves, so the worker owns every partition; then the jobs.
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await incumbent.stop()
        jobs = [job(i, max_tokens=4) for i in range(24)]
        await produce(kafka_bootstrap, topics.jobs, jobs)
        records = await read_topic(kafka_bootstrap, topics.results, lambda r: len({x.key for x in r}) >= len(jobs),
                                   timeout=120)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        code = stop_process(proc, signal.SIGTERM)
        proc = None
    finally:
        if not polling.done():
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)
        await incumbent.stop()
        if proc is not None:
            stop_process(proc, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "Did you call `start` twice?" not in text
    assert listener.revoked_after >= REVOKE_S - 0.5  # the join really took longer than one try
    results = results_by_job(records)
    assert sorted(results) == sorted(j["job_id"] for j in jobs)
    assert all(r["status"] == "ok" for v in results.values() for r in v)
    assert _events(log, "joining the consumer group")
    assert not [e for e in _events(log, "no broker reachable yet; waiting") if e.get("client") == "consumer"]
