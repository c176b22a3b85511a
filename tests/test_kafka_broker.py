"""The local Kafka node (`tokenmill kafka ...`, deploy/kafka/kafka.sh) and topic creation.

The restart tests run their own node on their own ports and data directory, so they never
disturb the session broker the other Kafka tests share.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import UnknownTopicOrPartitionError

from tokenmill.cli import main
from tokenmill.kafka.admin import TopicError, TopicSpec, create_topic, delete_topics, ensure_topics
from tokenmill.kafka.local_broker import LocalKafka, LocalKafkaError, free_port, kafka_script

pytestmark = pytest.mark.kafka


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _partitions(bootstrap: str, topic: str) -> set[int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        return await producer.partitions_for(topic)
    finally:
        await producer.stop()


async def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def _consume_all(bootstrap: str, topic: str, expect: int, timeout: float = 20.0) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    values: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout
        while len(values) < expect and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            values += [m.value for msgs in batch.values() for m in msgs]
    finally:
        await consumer.stop()
    return values


def test_cli_start_status_stop_restart_keeps_data(tmp_path, capsys):
    port, controller_port = _free_ports(2)
    data_dir = str(tmp_path / "node")
    bootstrap = f"127.0.0.1:{port}"
    topic = "restart-check"

    # Never started: status says stopped (exit 3).
    assert main(["kafka", "status", "--data-dir", data_dir]) == 3
    assert "stopped" in capsys.readouterr().out

    assert main(["kafka", "start", "--port", str(port), "--controller-port", str(controller_port),
                 "--data-dir", data_dir]) == 0
    try:
        assert bootstrap in capsys.readouterr().out
        assert main(["kafka", "status", "--data-dir", data_dir]) == 0
        assert "running" in capsys.readouterr().out
        # A second start on a running node is a no-op, not an error.
        assert main(["kafka", "start", "--data-dir", data_dir]) == 0
        capsys.readouterr()

        assert main(["kafka", "create-topic", topic, "--partitions", "2",
                     "--bootstrap-servers", bootstrap]) == 0
        asyncio.run(_produce(bootstrap, topic, b"written before the stop"))

        assert main(["kafka", "stop", "--data-dir", data_dir]) == 0
        assert main(["kafka", "status", "--data-dir", data_dir]) == 3
        assert "stopped" in capsys.readouterr().out.splitlines()[-1]
        assert not (tmp_path / "node" / "kafka.pid").exists()
        with socket.socket() as sock:  # the port is really closed
            assert sock.connect_ex(("127.0.0.1", port)) != 0

        # Start again without --port: the node comes back on the recorded ports, same data.
        assert main(["kafka", "start", "--data-dir", data_dir]) == 0
        assert bootstrap in capsys.readouterr().out
        assert asyncio.run(_consume_all(bootstrap, topic, expect=1)) == [b"written before the stop"]
        # The topic kept its partitions (asking for another count is refused).
        assert main(["kafka", "create-topic", topic, "--partitions", "3",
                     "--bootstrap-servers", bootstrap]) == 1
        assert "exists with 2 partitions" in capsys.readouterr().err
    finally:
        main(["kafka", "stop", "--data-dir", data_dir])
    assert main(["kafka", "status", "--data-dir", data_dir]) == 3
    # Class-data sharing: after a clean stop an archive sits next to the jars, none in the node.
    if os.environ.get("TOKENMILL_KAFKA_CDS", "1") != "0":
        libs = subprocess.run(["bash", str(kafka_script()), "libs"], capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
        assert list((tmp_path / "node").glob("cds*")) == []
        assert list(Path(libs).parent.glob("cds-*.jsa"))
    # The storage was formatted once: the restart did not re-format it.
    log = (tmp_path / "node" / "kafka.log").read_text()
    assert log.count("=== start") == 2
    assert log.count("Formatting dynamic metadata voter directory") == 1


def test_cluster_ids_never_start_with_a_dash():
    """One random id in 64 starts with '-'; the storage tool's parser read that as an option and
    every Kafka test of the run failed at broker start. 1,000 ids hold ~16 such ids if unfixed (none
    at all once in 7 million runs); each id costs four processes, so not more."""
    script = kafka_script().read_text()
    func = re.search(r"^new_cluster_id\(\) \{.*?^\}", script, re.S | re.M)
    assert func, "new_cluster_id() not found in kafka.sh"
    out = subprocess.run(
        ["bash", "-c", func.group(0) + "\nfor _ in $(seq 1000); do new_cluster_id; done"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()
    assert len(out) == 1000
    bad = [i for i in out if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]{21}", i)]
    assert not bad, bad[:5]


def test_start_refuses_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        broker = LocalKafka(port=port, data_dir=tmp_path / "node")
        with pytest.raises(LocalKafkaError, match=f"port {port} on 127.0.0.1 is already in use"):
            broker.start(timeout=30)
    assert not broker.status().running


def test_start_failure_reports_the_log_tail_at_once(tmp_path):
    """A broker that dies while starting is reported with the reason from its log, without
    waiting for the start timeout."""
    node = tmp_path / "node"
    (node / "log").mkdir(parents=True)
    (node / "log" / "meta.properties").write_text("not=a kafka meta file\n")  # skips formatting
    port, controller_port = _free_ports(2)
    started = time.monotonic()
    with pytest.raises(LocalKafkaError) as failure:
        LocalKafka(port=port, data_dir=node, controller_port=controller_port).start(timeout=120)
    assert time.monotonic() - started < 60
    assert "Kafka exited during start-up" in str(failure.value)
    assert "node ID not found" in str(failure.value)  # the broker's own reason, from the log tail
    assert not LocalKafka(data_dir=node).status().running


def test_stale_pid_file_reads_as_stopped(tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    # A pid that exists but is not a Kafka of this data directory (this test process).
    (node / "kafka.pid").write_text(str(os.getpid()))
    (node / "ports").write_text("port=1\ncontroller_port=2\n")
    status = LocalKafka(data_dir=node).status()
    assert not status.running and status.pid is None
    assert "stopped" in status.message
    LocalKafka(data_dir=node).stop()  # stopping a stopped node is fine and kills nothing
    assert not (node / "kafka.pid").exists()


def test_node_stops_when_its_owner_process_dies(tmp_path):
    """The fixture passes its pid as owner: a killed test run must not leave a JVM behind."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        port, controller_port = _free_ports(2)
        broker = LocalKafka(port=port, data_dir=tmp_path / "node", controller_port=controller_port)
        broker.start(timeout=120, owner_pid=owner.pid)
        status = broker.status()
        assert status.running and status.pid
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 60
        while _alive(status.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(status.pid)
        assert not broker.status().running
    finally:
        owner.kill()
        owner.wait()
        LocalKafka(data_dir=tmp_path / "node").stop()


# ---- topic creation against the session broker ----------------------------------------------


async def test_create_topic_is_idempotent_and_checks_partitions(kafka_bootstrap):
    name = f"admin-{uuid.uuid4().hex[:8]}"
    await create_topic(kafka_bootstrap, name, partitions=3, config={"retention.ms": "3600000"})
    await create_topic(kafka_bootstrap, name, partitions=3)  # exists with the same count: fine
    with pytest.raises(TopicError, match=f"topic {name} exists with 3 partitions, but 2 were asked for"):
        await create_topic(kafka_bootstrap, name, partitions=2)
    await delete_topics(kafka_bootstrap, [name, "never-existed-" + name])


async def test_ensure_topics_creates_several_and_reports_bad_ones(kafka_bootstrap):
    a, b = (f"ensure-{uuid.uuid4().hex[:8]}" for _ in range(2))
    await ensure_topics(kafka_bootstrap, {a: 2, b: 4})
    assert await _partitions(kafka_bootstrap, a) == {0, 1}
    assert await _partitions(kafka_bootstrap, b) == {0, 1, 2, 3}

    with pytest.raises(TopicError, match="invalid topic name 'no spaces'"):
        await ensure_topics(kafka_bootstrap, ["no spaces"])
    with pytest.raises(TopicError, match="partitions must be >= 1"):
        await ensure_topics(kafka_bootstrap, {"zero-partitions": 0})
    with pytest.raises(TopicError, match="listed twice with different settings"):
        await ensure_topics(kafka_bootstrap, [TopicSpec(a, 2), TopicSpec(a, 3)])
    with pytest.raises(TopicError, match=r"InvalidConfigurationError .*cleanup.policy"):
        await create_topic(kafka_bootstrap, f"badcfg-{uuid.uuid4().hex[:8]}",
                           config={"cleanup.policy": "sometimes"})
    # A replication factor the single node cannot satisfy is the broker's refusal, verbatim.
    with pytest.raises(TopicError, match="InvalidReplicationFactorError"):
        await create_topic(kafka_bootstrap, f"rf3-{uuid.uuid4().hex[:8]}", replication_factor=3)


async def test_session_broker_does_not_auto_create_topics(kafka_bootstrap):
    """Tests run with auto-creation off: producing to a topic nobody created fails."""
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, request_timeout_ms=1500)
    await producer.start()
    try:
        with pytest.raises(UnknownTopicOrPartitionError):
            await producer.send_and_wait(missing, b"x")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap)
    await consumer.start()
    try:
        assert missing not in await consumer.topics()
    finally:
        await consumer.stop()


def test_new_topic_fixture_makes_unique_ready_topics(new_topic, kafka_bootstrap):
    first, second = new_topic(), new_topic(partitions=3)
    assert first != second
    assert first.startswith("t-test-new-topic-fixture")  # dashes only: no "." / "_" collisions

    assert asyncio.run(_partitions(kafka_bootstrap, first)) == {0}
    assert asyncio.run(_partitions(kafka_bootstrap, second)) == {0, 1, 2}


def test_jars_lock_matches_the_pom_and_the_fetched_jars():
    """jars.lock (used to fetch without Maven) must name exactly the jars Maven resolves."""
    deploy = kafka_script().parent
    pom = (deploy / "pom.xml").read_text()
    kafka_version = re.search(r"<kafka.version>(.+?)</kafka.version>", pom).group(1)
    log4j_version = re.search(r"<log4j2.version>(.+?)</log4j2.version>", pom).group(1)
    lock = (deploy / "jars.lock").read_text().splitlines()
    assert f"kafka.version={kafka_version}" in lock
    entries = dict(line.split() for line in lock if line and not line.startswith(("#", "kafka.version=")))
    assert f"org.apache.kafka:kafka_2.13:{kafka_version}" in entries
    assert f"org.apache.logging.log4j:log4j-core:{log4j_version}" in entries

    if os.environ.get("TOKENMILL_KAFKA_VERSION", kafka_version) != kafka_version:
        return  # the cache holds another version's jars; only the pom/lock agreement applies
    libs = subprocess.run(["bash", str(kafka_script()), "libs"], capture_output=True, text=True,
                          check=True, timeout=900).stdout.strip()
    fetched = {name: hashlib.sha256(open(os.path.join(libs, name), "rb").read()).hexdigest()
               for name in os.listdir(libs) if name.endswith(".jar")}
    locked = {f"{coords.split(':')[1]}-{coords.split(':')[2]}.jar": digest for coords, digest in entries.items()}
    assert fetched == locked


async def _topic_config(bootstrap: str, topic: str, keys: list[str]) -> dict[str, str]:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, dict.fromkeys(keys))])
    finally:
        await admin.close()
    resource = response.resources[0]
    return {entry[0]: entry[1] for entry in resource[4]}


def test_cli_create_topic_applies_configs(kafka_bootstrap, capsys, monkeypatch):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    assert main(["kafka", "create-topic", name, "--partitions", "2", "--bootstrap-servers", kafka_bootstrap,
                 "--config", "retention.ms=123456", "cleanup.policy=compact"]) == 0
    assert asyncio.run(_topic_config(kafka_bootstrap, name, ["retention.ms", "cleanup.policy"])) == {
        "retention.ms": "123456", "cleanup.policy": "compact"}
    assert asyncio.run(_partitions(kafka_bootstrap, name)) == {0, 1}

    # The same through the environment (comma-separated), as every flag allows.
    env_name = f"cli-env-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TOKENMILL_CONFIG", "retention.ms=654321")
    monkeypatch.setenv("TOKENMILL_BOOTSTRAP_SERVERS", kafka_bootstrap)
    assert main(["kafka", "create-topic", env_name]) == 0
    assert asyncio.run(_topic_config(kafka_bootstrap, env_name, ["retention.ms"])) == {"retention.ms": "654321"}

    assert main(["kafka", "create-topic", f"cli-bad-{uuid.uuid4().hex[:8]}", "--config", "no-equals-sign"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_refused_creation_is_fine_only_for_a_topic_that_already_fits():
    """Decision rule behind ensure_topics for brokers that refuse CreateTopics (no ACL): the
    local broker has no authorizer, so the rule is checked on metadata entries directly."""
    from tokenmill.kafka.admin import unresolved_refusals

    def entry(topic: str, partitions: int, error_code: int = 0) -> dict:
        return {"topic": topic, "error_code": error_code,
                "partitions": [{"partition": p, "leader": 1} for p in range(partitions)]}

    metadata = [entry("jobs", 8), entry("dlq", 4), entry("hidden", 8, error_code=29)]
    refused = {name: "TopicAuthorizationFailedError (denied)" for name in ("jobs", "dlq", "results", "hidden")}
    wanted = {"jobs": 8, "dlq": 8, "results": 8, "hidden": 8}
    assert unresolved_refusals(refused, metadata, wanted) == [
        "dlq: TopicAuthorizationFailedError (denied)",  # exists, wrong count
        "results: TopicAuthorizationFailedError (denied)",  # does not exist
        "hidden: TopicAuthorizationFailedError (denied)",  # not readable either
    ]
