"""What tokenmill relies on from aiokafka, proven against the real Apache Kafka 4.x broker.

aiokafka's own CI stops at Kafka 2.8 and Kafka 4.0 removed many old protocol versions
(KIP-896), so each feature the worker uses gets a test here: keys and headers, manual commits,
group failover (dead member and clean leave), the idempotent producer (including a replayed
batch), and transactions with send_offsets_to_transaction read back with read_committed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

pytestmark = pytest.mark.kafka

# Group timings for the failover tests: the broker allows sessions down to 500 ms.
SHORT_SESSION_MS = 1000
HEARTBEAT_MS = 200


def _uid() -> str:
    return uuid.uuid4().hex[:10]


async def _read(bootstrap: str, topic: str, *, expect: int | None = None, idle_s: float = 1.5,
                timeout_s: float = 20.0, **consumer_kw) -> list:
    """Read a topic from the beginning (no group) until ``expect`` records or ``idle_s`` of silence."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, **consumer_kw)
    await consumer.start()
    records: list = []
    try:
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            got = [m for msgs in batch.values() for m in msgs]
            if got:
                records += got
                last_new = time.monotonic()
            if expect is not None and len(records) >= expect:
                # Keep polling briefly: more than expected must show up as a failure.
                if time.monotonic() - last_new >= 0.5:
                    break
            elif expect is None and time.monotonic() - last_new >= idle_s:
                break
    finally:
        await consumer.stop()
    return sorted(records, key=lambda m: (m.partition, m.offset))


async def _produce(bootstrap: str, topic: str, items: list[tuple[int | None, bytes | None, bytes]]) -> None:
    """Send (partition, key, value) records and wait for every acknowledgement."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key, partition=p) for p, key, value in items]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


# ---- protocol versions ---------------------------------------------------------------------


def _aiokafka_request_types() -> dict[str, tuple[int, list[int]]]:
    """Every request type aiokafka implements: name -> (API key, versions it can encode)."""
    import importlib
    import inspect
    import pkgutil

    import aiokafka.protocol as protocol
    from aiokafka.protocol.api import Request

    found: dict[str, tuple[int, list[int]]] = {}
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"{protocol.__name__}.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Request) and cls is not Request and cls.__module__ == module.__name__:
                found[name] = (cls.API_KEY, sorted(c.API_VERSION for c in cls._CLASSES))
    return found


async def test_broker_accepts_a_version_of_every_request_aiokafka_sends(kafka_bootstrap):
    """Kafka 4.0 dropped old protocol versions (KIP-896). Ask the broker which versions it
    serves and check that each request type aiokafka implements still has one in common, so a
    Kafka upgrade that drops more fails here, by name, rather than deep inside the worker."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.protocol.admin import ApiVersionRequest

    client = AIOKafkaClient(bootstrap_servers=kafka_bootstrap)
    await client.bootstrap()
    try:
        response = await client.send(client.get_random_node(), ApiVersionRequest())
    finally:
        await client.close()
    assert response.error_code == 0
    broker = {key: (low, high) for key, low, high in response.api_versions}

    requests = _aiokafka_request_types()
    # The ones tokenmill uses must be among them (guards against this test finding nothing).
    assert {"ProduceRequest", "FetchRequest", "JoinGroupRequest", "OffsetCommitRequest",
            "InitProducerIdRequest", "AddOffsetsToTxnRequest", "TxnOffsetCommitRequest",
            "EndTxnRequest", "CreateTopicsRequest"} <= set(requests)
    unusable = {
        name: f"aiokafka v{versions[0]}-v{versions[-1]}, broker {broker.get(key)}"
        for name, (key, versions) in requests.items()
        if not any(key in broker and broker[key][0] <= v <= broker[key][1] for v in versions)
    }
    assert unusable == {}


# ---- keys and headers ----------------------------------------------------------------------


async def test_keys_headers_and_timestamps_round_trip(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1)
    sent = [
        (b"job-1", b"plain", [("tokenmill.error.code", b"invalid_job"), ("n", b"1")]),
        (None, b"no key", []),
        (b"", b"empty key", [("empty", b"")]),
        (b"\x00\xff binary", None, [("bin", bytes(range(256)))]),  # a tombstone with headers
        (b"dup", b"repeated header keys keep order", [("h", b"1"), ("h", b"2"), ("h", b"3")]),
        ("ключ".encode(), "значение".encode(), [("ünïcode-kéy", "välue".encode())]),
    ]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i, (key, value, headers) in enumerate(sent):
            await producer.send_and_wait(topic, value, key=key, headers=headers, timestamp_ms=1_700_000_000_000 + i)
    finally:
        await producer.stop()

    got = await _read(kafka_bootstrap, topic, expect=len(sent))
    assert [(m.key, m.value, list(m.headers)) for m in got] == [(k, v, h) for k, v, h in sent]
    assert [m.timestamp for m in got] == [1_700_000_000_000 + i for i in range(len(sent))]
    assert [m.offset for m in got] == list(range(len(sent)))


async def test_same_key_always_lands_on_the_same_partition(kafka_bootstrap, new_topic):
    """Prefix-affinity keys rely on the default (murmur2) partitioner being deterministic."""
    topic = new_topic(partitions=4)
    keys = [f"prefix-{i % 5}".encode() for i in range(40)]
    await _produce(kafka_bootstrap, topic, [(None, k, b"v%d" % i) for i, k in enumerate(keys)])
    got = await _read(kafka_bootstrap, topic, expect=len(keys))
    partitions_of: dict[bytes, set[int]] = {}
    for m in got:
        partitions_of.setdefault(m.key, set()).add(m.partition)
    assert len(got) == 40
    assert all(len(ps) == 1 for ps in partitions_of.values()), partitions_of
    assert len({next(iter(ps)) for ps in partitions_of.values()}) > 1  # keys do spread


# ---- manual commits ------------------------------------------------------------------------


async def test_group_resumes_exactly_from_committed_offsets(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    group = f"g-{_uid()}"
    await _produce(kafka_bootstrap, topic, [(p, None, f"{p}-{i}".encode()) for p in (0, 1) for i in range(10)])
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)

    def member() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=group,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                session_timeout_ms=6000, heartbeat_interval_ms=HEARTBEAT_MS)

    async def take(consumer: AIOKafkaConsumer, tp: TopicPartition, n: int) -> list[int]:
        """The next n offsets of one partition (the other is paused)."""
        offsets: list[int] = []
        deadline = time.monotonic() + 20
        while len(offsets) < n and time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=300, max_records=n - len(offsets))
            offsets += [m.offset for m in batch.get(tp, [])]
        return offsets

    # 1st member: read 4 from partition 0 and 7 from partition 1, commit what it consumed.
    first = member()
    await first.start()
    try:
        assert await take(first, tp0, 4) == [0, 1, 2, 3]
        assert await take(first, tp1, 7) == list(range(7))
        await first.commit()
        assert await first.committed(tp0) == 4 and await first.committed(tp1) == 7
    finally:
        await first.stop()

    # 2nd member: starts exactly there; reads more, but commits an explicit lower point
    # (what a worker does when later jobs finished before earlier ones), with metadata.
    second = member()
    await second.start()
    try:
        assert await take(second, tp0, 3) == [4, 5, 6]
        assert await take(second, tp1, 1) == [7]
        await second.commit({tp0: OffsetAndMetadata(5, "watermark"), tp1: 8})
    finally:
        await second.stop()

    # 3rd member: resumes at the explicit points, not at what the 2nd member had read.
    third = member()
    await third.start()
    try:
        assert await take(third, tp0, 5) == [5, 6, 7, 8, 9]
        assert await take(third, tp1, 2) == [8, 9]
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(group)
        finally:
            await admin.close()
        assert offsets[tp0].offset == 5 and offsets[tp0].metadata == "watermark"
        assert offsets[tp1].offset == 8
    finally:
        await third.stop()


# ---- group failover ------------------------------------------------------------------------

# A group member in its own process, so it can die without leaving the group (SIGKILL).
# It prints its assignment whenever it changes and every record it reads, and commits each batch.
_MEMBER = r"""
import asyncio, json, sys
from aiokafka import AIOKafkaConsumer

async def main(bootstrap, topic, group, session_ms, heartbeat_ms):
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                session_timeout_ms=session_ms, heartbeat_interval_ms=heartbeat_ms)
    await consumer.start()
    shown = None
    while True:
        batch = await consumer.getmany(timeout_ms=100)
        for tp, msgs in batch.items():
            for m in msgs:
                print(json.dumps({"record": [tp.partition, m.offset, m.value.decode()]}), flush=True)
        if batch:
            await consumer.commit()
            print(json.dumps({"committed": True}), flush=True)
        now = sorted(tp.partition for tp in consumer.assignment())
        if now != shown:
            shown = now
            print(json.dumps({"assignment": now}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
"""


class _ProcessMember:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.assignment: list[int] | None = None
        self.records: list[tuple[int, int, str]] = []
        self.committed_count = 0  # how many of its records were read before its last commit

    @classmethod
    async def start(cls, bootstrap: str, topic: str, group: str, session_ms: int) -> _ProcessMember:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _MEMBER, bootstrap, topic, group, str(session_ms), str(HEARTBEAT_MS),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        return cls(proc)

    async def until(self, predicate, timeout: float = 30.0) -> None:
        """Read its output until predicate(self) holds."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"member state not reached: assignment={self.assignment} records={self.records}")
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not line:
                raise AssertionError(f"member process exited (code {self.proc.returncode})")
            event = json.loads(line)
            if "assignment" in event:
                self.assignment = event["assignment"]
            elif "record" in event:
                self.records.append(tuple(event["record"]))
            elif "committed" in event:
                self.committed_count = len(self.records)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()


class _InProcessMember:
    """A consumer polled by a background task, recording its assignment and records."""

    def __init__(self, bootstrap: str, topic: str, group: str, session_ms: int) -> None:
        self.consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                         enable_auto_commit=False, auto_offset_reset="earliest",
                                         session_timeout_ms=session_ms, heartbeat_interval_ms=HEARTBEAT_MS)
        self.records: list[tuple[int, int, str]] = []
        self.committed_count = 0  # how many of its records were read before its last commit
        self.changes: list[tuple[float, list[int]]] = []  # (monotonic time, assignment)
        self._task: asyncio.Task | None = None

    @property
    def assignment(self) -> list[int]:
        return sorted(tp.partition for tp in self.consumer.assignment())

    async def start(self) -> None:
        await self.consumer.start()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=100)
            for tp, msgs in batch.items():
                self.records += [(tp.partition, m.offset, m.value.decode()) for m in msgs]
            if batch:
                await self.consumer.commit()
                self.committed_count = len(self.records)
            now = self.assignment
            if not self.changes or self.changes[-1][1] != now:
                self.changes.append((time.monotonic(), now))

    async def until(self, predicate, timeout: float = 30.0) -> float:
        """Wait until predicate(self) holds; returns the monotonic time it was first seen."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if self._task is not None and self._task.done():
                self._task.result()  # surface the polling error
            if time.monotonic() > deadline:
                raise AssertionError(f"state not reached: assignment={self.assignment} records={self.records}")
            await asyncio.sleep(0.05)
        return time.monotonic()

    async def stop(self) -> None:
        """Clean shutdown: aiokafka sends LeaveGroup, so the group rebalances at once."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.consumer.stop()


@pytest.mark.parametrize("how", ["dies", "leaves"])
async def test_two_members_split_partitions_and_one_takes_over(kafka_bootstrap, new_topic, how):
    """'dies': the other member is SIGKILLed (no LeaveGroup; noticed after the session timeout).
    'leaves': it stops cleanly (LeaveGroup; the rebalance starts at once)."""
    topic = new_topic(partitions=4)
    group = f"g-{_uid()}"
    # A dead member is only noticed after its session times out; a clean leave needs no timeout,
    # so that case runs with a long session to show that the takeover did not wait for it.
    session_ms = SHORT_SESSION_MS if how == "dies" else 20_000

    if how == "dies":
        other = await _ProcessMember.start(kafka_bootstrap, topic, group, session_ms)
        await other.until(lambda m: m.assignment == [0, 1, 2, 3])
    else:
        other = _InProcessMember(kafka_bootstrap, topic, group, session_ms)
        await other.start()
        await other.until(lambda m: m.assignment == [0, 1, 2, 3])

    survivor = _InProcessMember(kafka_bootstrap, topic, group, session_ms)
    try:
        await survivor.start()
        await survivor.until(lambda m: len(m.assignment) == 2)
        await other.until(lambda m: len(m.assignment) == 2)
        assert sorted(survivor.assignment + other.assignment) == [0, 1, 2, 3]
        theirs = list(other.assignment)

        # Each member reads (and commits) the records of its own partitions.
        await _produce(kafka_bootstrap, topic, [(p, None, f"before-{p}".encode()) for p in range(4)])
        await other.until(lambda m: len(m.records) == 2 and m.committed_count == 2)
        await survivor.until(lambda m: len(m.records) == 2)
        assert sorted(r[0] for r in other.records) == theirs
        assert sorted(r[0] for r in survivor.records) == sorted(set(range(4)) - set(theirs))

        gone_at = time.monotonic()
        if how == "dies":
            await other.kill()
        else:
            await other.stop()
        took_over_at = await survivor.until(lambda m: m.assignment == [0, 1, 2, 3], timeout=60)
        takeover_s = took_over_at - gone_at
        print(f"takeover after the other member {how}: {takeover_s:.2f} s (session {session_ms} ms)")

        # The survivor continues the dead member's partitions from their committed offsets:
        # the 'before' records it already handled are not delivered again, new ones are.
        await _produce(kafka_bootstrap, topic, [(p, None, f"after-{p}".encode()) for p in range(4)])
        await survivor.until(lambda m: sum(r[2].startswith("after-") for r in m.records) == 4)
        await asyncio.sleep(0.5)
        values = sorted(r[2] for r in survivor.records)
        expected_before = sorted(f"before-{p}" for p in range(4) if p not in theirs)
        assert values == sorted(expected_before + [f"after-{p}" for p in range(4)])
    finally:
        await survivor.stop()
        if how == "dies":
            await other.kill()

    if how == "dies":
        # Detected through the session timeout: not before it, and not much after it.
        assert session_ms / 1000 * 0.8 <= takeover_s < 15, takeover_s
    else:
        # LeaveGroup made the rebalance immediate: far sooner than the 20 s session timeout.
        assert takeover_s < 8, takeover_s


# ---- idempotent producer -------------------------------------------------------------------


async def test_idempotent_producer_delivers_each_record_once_in_order(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True,
                                linger_ms=5, max_batch_size=4096)
    await producer.start()
    try:
        # Many small batches in flight at once, as the worker's publisher sends results.
        futures = [await producer.send(topic, f"r{i:04d}".encode(), key=b"k") for i in range(500)]
        metas = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    assert [m.offset for m in metas] == list(range(500))
    got = await _read(kafka_bootstrap, topic, expect=500)
    assert [m.value for m in got] == [f"r{i:04d}".encode() for i in range(500)]


async def _raw_produce_twice(bootstrap: str, topic: str, producer_id: int, epoch: int, sequence: int):
    """Send the same record batch twice, as a producer retry after a lost response does."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.protocol.produce import ProduceRequest
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0,
                                            producer_id=producer_id, producer_epoch=epoch,
                                            base_sequence=sequence, batch_size=16384)
        builder.append(0, timestamp=None, key=b"k", value=f"seq-{sequence}".encode(), headers=[])
        batch = bytes(builder.build())
        request = ProduceRequest(transactional_id=None, required_acks=-1, timeout=10000,
                                 topics=[(topic, [(0, batch)])])
        node = client.cluster.leader_for_partition(TopicPartition(topic, 0))
        if node is None:
            await client.force_metadata_update()
            node = client.cluster.leader_for_partition(TopicPartition(topic, 0))
        answers = []
        for _ in range(2):
            response = await client.send(node, request)
            part = response.topics[0][1][0]
            answers.append((part[1], part[2]))  # (error_code, base offset)
        return answers
    finally:
        await client.close()


async def test_broker_drops_a_replayed_idempotent_batch(kafka_bootstrap, new_topic):
    """The point of idempotence: a retried batch (same producer id, epoch, sequence) is stored
    once. Control: the same replay without a producer id is stored twice."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.protocol.transaction import InitProducerIdRequest

    topic = new_topic(partitions=1)
    client = AIOKafkaClient(bootstrap_servers=kafka_bootstrap)
    await client.bootstrap()
    try:
        # What AIOKafkaProducer(enable_idempotence=True) asks for on start.
        init = await client.send(client.get_random_node(), InitProducerIdRequest(None, 60000))
    finally:
        await client.close()
    assert init.error_code == 0 and init.producer_id >= 0

    replay = await _raw_produce_twice(kafka_bootstrap, topic, init.producer_id, init.producer_epoch, 0)
    # Both answers succeed and point at the same offset: the second write was recognised.
    assert replay == [(0, 0), (0, 0)]
    control = await _raw_produce_twice(kafka_bootstrap, topic, -1, -1, -1)
    assert control == [(0, 1), (0, 2)]

    got = await _read(kafka_bootstrap, topic, expect=3)
    assert [m.value for m in got] == [b"seq-0", b"seq--1", b"seq--1"]


# ---- transactions --------------------------------------------------------------------------


async def _committed_when(consumer: AIOKafkaConsumer, tp: TopicPartition, expect: int,
                          timeout_s: float = 10.0) -> int | None:
    """The group's committed offset, polled until it equals ``expect`` (or the time is up).

    commit_transaction() returns when the coordinator has logged the decision; the offsets
    become visible to OffsetFetch (v0-v3 in aiokafka, without KIP-447's require_stable) a moment
    later, when the marker reaches __consumer_offsets (measured: up to ~0.2 s). Until then the
    previous value is returned.
    """
    deadline = time.monotonic() + timeout_s
    value = await consumer.committed(tp)
    while value != expect and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        value = await consumer.committed(tp)
    return value


async def _committed_values(consumer: AIOKafkaConsumer, tp: TopicPartition, during_s: float) -> set:
    """Every committed offset seen while polling for ``during_s`` seconds."""
    seen = set()
    deadline = time.monotonic() + during_s
    while time.monotonic() < deadline:
        seen.add(await consumer.committed(tp))
        await asyncio.sleep(0.05)
    return seen


async def test_transactions_commit_results_and_offsets_together(kafka_bootstrap, new_topic):
    """Consume-transform-produce as the --exactly-once worker does it: outputs and the input
    offset go in one transaction. An aborted transaction leaves neither outputs visible to a
    read_committed reader nor its offset committed."""
    jobs, results = new_topic(partitions=1), new_topic(partitions=1)
    group = f"g-{_uid()}"
    tp = TopicPartition(jobs, 0)
    await _produce(kafka_bootstrap, jobs, [(0, f"job-{i}".encode(), f"job-{i}".encode()) for i in range(6)])

    async def member() -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(jobs, bootstrap_servers=kafka_bootstrap, group_id=group,
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    isolation_level="read_committed")
        await consumer.start()
        return consumer

    async def take(consumer: AIOKafkaConsumer, n: int) -> list:
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=300, max_records=n - len(got))
            got += batch.get(tp, [])
        return got

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{_uid()}",
                                transaction_timeout_ms=20000)
    await producer.start()
    try:
        consumer = await member()
        try:
            # Transaction 1: jobs 0-2 -> results, offset 3; committed.
            jobs_read = await take(consumer, 3)
            async with producer.transaction():
                for m in jobs_read:
                    await producer.send(results, b"result:" + m.value, key=m.key)
                await producer.send_offsets_to_transaction({tp: jobs_read[-1].offset + 1}, group)
            assert await _committed_when(consumer, tp, 3) == 3

            # Transaction 2: jobs 3-5 -> results, offset 6; aborted (e.g. the worker crashed).
            jobs_read = await take(consumer, 3)
            assert [m.offset for m in jobs_read] == [3, 4, 5]
            await producer.begin_transaction()
            for m in jobs_read:
                await producer.send(results, b"aborted:" + m.value, key=m.key)
            await producer.send_offsets_to_transaction({tp: 6}, group)
            await producer.abort_transaction()
            assert await _committed_values(consumer, tp, during_s=1.0) == {3}
        finally:
            await consumer.stop()

        # A new member resumes at the last committed transaction's offset and redoes 3-5.
        consumer = await member()
        try:
            jobs_read = await take(consumer, 3)
            assert [m.offset for m in jobs_read] == [3, 4, 5]
            async with producer.transaction():
                for m in jobs_read:
                    await producer.send(results, b"result:" + m.value, key=m.key)
                await producer.send_offsets_to_transaction({tp: 6}, group)
            assert await _committed_when(consumer, tp, 6) == 6
        finally:
            await consumer.stop()
    finally:
        await producer.stop()

    committed_view = await _read(kafka_bootstrap, results, expect=6, isolation_level="read_committed")
    assert [m.value for m in committed_view] == [b"result:job-%d" % i for i in range(6)]
    # The aborted records are in the log (a read_uncommitted reader sees them); read_committed
    # filtered them out, so the check above is about isolation, not about missing writes.
    raw_view = await _read(kafka_bootstrap, results, expect=9, isolation_level="read_uncommitted")
    assert [m.value for m in raw_view] == (
        [b"result:job-%d" % i for i in range(3)]
        + [b"aborted:job-%d" % i for i in range(3, 6)]
        + [b"result:job-%d" % i for i in range(3, 6)]
    )


async def test_read_committed_reader_waits_behind_an_open_transaction(kafka_bootstrap, new_topic):
    """Why the token stream must never sit inside a transaction: a read_committed reader sees
    nothing past the first open transaction, even records written later outside it."""
    topic = new_topic(partitions=1)
    tx = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{_uid()}")
    plain = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    await tx.start()
    await plain.start()
    try:
        await tx.begin_transaction()
        await (await tx.send(topic, b"in open transaction", partition=0))
        await plain.send_and_wait(topic, b"written after, no transaction", partition=0)
        assert await _read(kafka_bootstrap, topic, isolation_level="read_committed", idle_s=1.0) == []
        assert len(await _read(kafka_bootstrap, topic, expect=2)) == 2  # read_uncommitted sees both
        await tx.commit_transaction()
    finally:
        await plain.stop()
        await tx.stop()
    got = await _read(kafka_bootstrap, topic, expect=2, isolation_level="read_committed")
    assert [m.value for m in got] == [b"in open transaction", b"written after, no transaction"]


async def test_new_producer_with_same_transactional_id_fences_the_old_one(kafka_bootstrap, new_topic):
    """A restarted worker (same transactional id) aborts its predecessor's open transaction,
    and the predecessor (a zombie) can no longer commit."""
    from aiokafka.errors import ProducerFenced

    topic = new_topic(partitions=1)
    transactional_id = f"tx-{_uid()}"
    old = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=transactional_id)
    new = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=transactional_id)
    await old.start()
    try:
        await old.begin_transaction()
        await (await old.send(topic, b"zombie", partition=0))
        await new.start()  # InitProducerId bumps the epoch and aborts the open transaction
        try:
            with pytest.raises(ProducerFenced):
                await old.commit_transaction()
            async with new.transaction():
                await new.send(topic, b"successor", partition=0)
        finally:
            await new.stop()
    finally:
        await old.stop()
    got = await _read(kafka_bootstrap, topic, expect=1, isolation_level="read_committed")
    assert [m.value for m in got] == [b"successor"]


async def test_successor_init_makes_predecessor_offsets_visible(kafka_bootstrap, new_topic):
    """aiokafka's OffsetFetch (v3) cannot ask for stable offsets (KIP-447), so right after a
    transaction commits its offsets may still read as the old value. A partition's new owner
    avoids that by starting the partition's transactional producer (same transactional id)
    first: InitProducerId returns only after the predecessor's transaction is complete."""
    topic = new_topic(partitions=1)
    group = f"g-{_uid()}"
    transactional_id = f"tx-{_uid()}"
    tp = TopicPartition(topic, 0)
    reader = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await reader.start()
    try:
        for round_, offset in enumerate((10, 20, 30)):
            predecessor = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=transactional_id)
            await predecessor.start()
            async with predecessor.transaction():
                await predecessor.send(topic, b"result %d" % round_, partition=0)
                await predecessor.send_offsets_to_transaction({tp: offset}, group)
            # The predecessor vanishes without a clean close (no further requests from it).
            successor = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=transactional_id)
            await successor.start()
            try:
                assert await reader.committed(tp) == offset  # read once, no polling
            finally:
                await successor.stop()
                await predecessor.stop()
    finally:
        await reader.stop()


# ---- static membership ---------------------------------------------------------------------


class _CountingListener:
    """Counts rebalances one member goes through (eager protocol: each one revokes all)."""

    def __init__(self) -> None:
        self.revoked = 0
        self.assigned: list[list[int]] = []

    async def on_partitions_revoked(self, revoked) -> None:
        self.revoked += 1

    async def on_partitions_assigned(self, assigned) -> None:
        self.assigned.append(sorted(tp.partition for tp in assigned))


async def test_static_member_restart_keeps_its_partitions_without_a_rebalance(kafka_bootstrap, new_topic):
    """group_instance_id (KIP-345): a worker restarting within the session timeout gets its
    partitions back and the other members are not disturbed. A static member's stop() sends no
    LeaveGroup, so if it does not come back its partitions move only after the session timeout."""
    from aiokafka.abc import ConsumerRebalanceListener

    topic = new_topic(partitions=4)
    group = f"g-{_uid()}"
    session_ms = 3000

    class Listener(_CountingListener, ConsumerRebalanceListener):
        pass

    def member(instance: str, listener: Listener) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group,
                                    group_instance_id=instance, enable_auto_commit=False,
                                    auto_offset_reset="earliest", session_timeout_ms=session_ms,
                                    heartbeat_interval_ms=HEARTBEAT_MS)
        consumer.subscribe([topic], listener=listener)
        return consumer

    async def poll_until(consumers, predicate, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, [sorted(tp.partition for tp in c.assignment()) for c in consumers]
            await asyncio.gather(*(c.getmany(timeout_ms=50) for c in consumers))
        return time.monotonic()

    def parts(consumer: AIOKafkaConsumer) -> list[int]:
        return sorted(tp.partition for tp in consumer.assignment())

    stay_listener, restart_listener = Listener(), Listener()
    stay = member("worker-a", stay_listener)
    first = member("worker-b", restart_listener)
    await stay.start()
    await first.start()
    second = None
    try:
        await poll_until([stay, first], lambda: len(parts(stay)) == 2 and len(parts(first)) == 2)
        before = parts(first)
        rebalances_seen_by_stay = stay_listener.revoked

        await first.stop()  # static: no LeaveGroup
        second = member("worker-b", Listener())
        await second.start()
        await poll_until([stay, second], lambda: parts(second) == before)
        await asyncio.gather(*(c.getmany(timeout_ms=500) for c in (stay, second)))
        assert parts(stay) == sorted(set(range(4)) - set(before))
        assert stay_listener.revoked == rebalances_seen_by_stay  # no rebalance for the other member

        # Now it goes away for good: nothing moves until its session times out.
        await second.stop()
        second = None
        gone_at = time.monotonic()
        took_over_at = await poll_until([stay], lambda: parts(stay) == [0, 1, 2, 3])
        assert (took_over_at - gone_at) >= session_ms / 1000 * 0.8
    finally:
        await stay.stop()
        if second is not None:
            await second.stop()
