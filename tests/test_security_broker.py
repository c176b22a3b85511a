"""Credentials and ACLs against a real SASL_SSL broker (SCRAM-SHA-512, a keytool-made CA,
StandardAuthorizer): the worker, produce, tail and backfill work with the right credentials and
the documented ACLs; refused credentials, an untrusted certificate or a missing ACL end each
command at once with one message and exit code 76 or 77; the worker's principal is refused
everything its ACLs do not name."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from tests.worker_helpers import REPO, job, results_by_job, running_worker, worker_command, worker_settings
from tokenmill.cli import main
from tokenmill.kafka.acls import (
    Acl,
    Operation,
    ResourceType,
    backfill_acls,
    list_acls,
    producer_acls,
    reader_acls,
    worker_acls,
)
from tokenmill.kafka.security import EXIT_NOT_AUTHENTICATED, EXIT_NOT_AUTHORIZED

pytestmark = [pytest.mark.kafka]

FAST_S = 30  # a refusal must end a command within this (no retry loop hides behind it)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tokenmill.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=16, max_num_batched_tokens=512,
                               kv_cache_gb=0.05, max_model_len=256))


def _acls_for_worker(t, user="worker", exactly_once=False):
    return worker_acls(user, group_id=t.group, jobs_topic=t.jobs, results_topic=t.results, tokens_topic=t.tokens,
                       dlq_topic=t.dlq, exactly_once=exactly_once)


async def _cli(*argv: str) -> tuple[int, float]:
    """Run a tokenmill command in a thread (it runs its own event loop); (exit code, seconds)."""
    t0 = time.monotonic()
    code = await asyncio.to_thread(main, list(argv))
    return code, time.monotonic() - t0


async def _run_refused(settings, engine) -> tuple[int, float, str]:
    """Run an in-process worker that the broker should refuse: (exit code, seconds, fatal error).
    A retry loop shows as a timeout here rather than as a test that never ends."""
    from tokenmill.kafka.worker import KafkaWorker

    w = KafkaWorker(settings, engine=engine)
    t0 = time.monotonic()
    code = await asyncio.wait_for(w.run(install_signal_handlers=False), FAST_S + 30)
    return code, time.monotonic() - t0, w.fatal_error or ""


def _one_error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}:")]
    assert len(lines) == 1, err
    return lines[0]


async def _admin_read(secure_kafka, topic, n, read_committed=False):
    # read_topic takes no security options: read as admin through a consumer of our own.
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=secure_kafka.bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None,
                                isolation_level="read_committed" if read_committed else "read_uncommitted",
                                **secure_kafka.options("admin"))
    await consumer.start()
    records = []
    try:
        deadline = time.monotonic() + 60
        while len({r.key for r in records}) < n and time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(recs)
    finally:
        await consumer.stop()
    return results_by_job(records)


async def test_worker_produce_tail_and_backfill_work_with_scram_credentials_and_their_acls(
        secure_kafka, engine, tiny_llama_dir, tmp_path, capsys):
    sk = secure_kafka
    t = await sk.topics("creds")
    await sk.grant(_acls_for_worker(t))
    await sk.grant(backfill_acls("client", t.jobs, t.results) + reader_acls("client", [t.tokens]))
    jobs = [job(i, stream=(i == 0)) for i in range(4)]
    jobs_file = tmp_path / "jobs.jsonl"
    jobs_file.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    client = ["--bootstrap-servers", sk.bootstrap, *sk.flags("client")]

    settings = worker_settings(sk.bootstrap, t, tiny_llama_dir, security=sk.security("worker"))
    async with running_worker(settings, engine) as (w, task):
        code, _ = await _cli("produce", str(jobs_file), *client, "--jobs-topic", t.jobs, "--no-progress")
        assert code == 0, capsys.readouterr().err
        code, _ = await _cli("tail", *client, "--results-topic", t.results, "--from-beginning", "--json",
                             "--count", "4", "--idle-timeout", "60")
        assert code == 0, capsys.readouterr().err
        results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert sorted(r["job_id"] for r in results) == sorted(j["job_id"] for j in jobs)
        assert all(r["status"] == "ok" for r in results), results
        code, _ = await _cli("tail", *client, "--tokens", "--tokens-topic", t.tokens, "--from-beginning", "--json",
                             "--count", "1", "--idle-timeout", "60")
        assert code == 0, capsys.readouterr().err
        (stream,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert stream["job_id"] == jobs[0]["job_id"] and stream["token_ids"]
        code, _ = await _cli("backfill", "--input", str(dataset), "--output", str(tmp_path / "out.jsonl"),
                             "--prompt-column", "text", "--max-tokens", "3", "--engine", "kafka", *client,
                             "--jobs-topic", t.jobs, "--results-topic", t.results, "--timeout", "90",
                             "--no-progress")
        assert code == 0, capsys.readouterr().err
    assert task.result() == 0, w.fatal_error
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["status"] == "ok" for row in rows), rows


async def test_exactly_once_worker_runs_with_its_transactional_id_acls(secure_kafka, engine, tiny_llama_dir):
    sk = secure_kafka
    t = await sk.topics("eos")
    await sk.grant(_acls_for_worker(t, exactly_once=True))
    producer = AIOKafkaProducer(bootstrap_servers=sk.bootstrap, acks="all", **sk.options("admin"))
    await producer.start()
    try:
        for i in range(3):
            await producer.send_and_wait(t.jobs, json.dumps(job(i)).encode(), key=f"job-{i:05d}".encode())
    finally:
        await producer.stop()
    settings = worker_settings(sk.bootstrap, t, tiny_llama_dir, security=sk.security("worker"), exactly_once=True)
    async with running_worker(settings, engine) as (w, task):
        results = await _admin_read(sk, t.results, 3, read_committed=True)
    assert task.result() == 0, w.fatal_error
    assert sorted(results) == [f"job-{i:05d}" for i in range(3)]
    assert all(len(v) == 1 and v[0]["status"] == "ok" for v in results.values()), results


async def test_a_wrong_password_ends_every_command_at_once_with_exit_76(secure_kafka, tiny_llama_dir, tmp_path,
                                                                        capsys):
    sk = secure_kafka
    t = await sk.topics("badpw")
    wrong = ["--bootstrap-servers", sk.bootstrap, *sk.flags("client", "not-the-password")]
    (tmp_path / "jobs.jsonl").write_text(json.dumps(job(0)) + "\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    for argv in (["produce", str(tmp_path / "jobs.jsonl"), *wrong, "--jobs-topic", t.jobs, "--no-progress"],
                 ["tail", *wrong, "--results-topic", t.results, "--idle-timeout", "60"],
                 ["backfill", "--input", str(tmp_path / "rows.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                  "--prompt-column", "text", "--engine", "kafka", *wrong, "--jobs-topic", t.jobs,
                  "--results-topic", t.results, "--timeout", "60", "--no-progress"]):
        code, seconds = await _cli(*argv)
        line = _one_error_line(capsys.readouterr().err, f"tokenmill {argv[0]}")
        assert code == EXIT_NOT_AUTHENTICATED, line
        assert seconds < FAST_S
        assert "authentication failed" in line and "not-the-password" not in line, line

    # The worker command checks the credentials before it loads the model.
    cmd = worker_command(sk.bootstrap, t, tiny_llama_dir, *sk.flags("worker", "not-the-password"))
    t0 = time.monotonic()
    proc = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == EXIT_NOT_AUTHENTICATED, proc.stderr[-3000:]
    assert seconds < FAST_S, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr, "tokenmill worker")
    assert "authentication failed" in line and "'worker'" in line and "not-the-password" not in line, line


async def test_an_untrusted_broker_certificate_is_exit_76_not_an_outage(secure_kafka, engine, tiny_llama_dir,
                                                                         capsys):
    sk = secure_kafka
    t = await sk.topics("untrusted")
    code, seconds = await _cli("tail", "--bootstrap-servers", sk.bootstrap, *sk.flags("client", cafile=False),
                               "--results-topic", t.results, "--idle-timeout", "60")
    line = _one_error_line(capsys.readouterr().err, "tokenmill tail")
    assert code == EXIT_NOT_AUTHENTICATED and seconds < FAST_S, line
    assert "certificate is not trusted" in line and "--ssl-cafile" in line, line

    security = sk.security("worker")
    security.ssl_cafile = None  # the system's CAs do not know ours
    code, seconds, error = await _run_refused(worker_settings(sk.bootstrap, t, tiny_llama_dir, security=security),
                                              engine)
    assert code == EXIT_NOT_AUTHENTICATED and seconds < FAST_S, error
    assert "certificate is not trusted" in error


async def test_a_missing_acl_stops_the_worker_and_the_clients_with_exit_77(secure_kafka, engine, tiny_llama_dir,
                                                                            tmp_path, capsys):
    sk = secure_kafka
    # No READ on the jobs topic: found once the producer is up, before the group is joined.
    t = await sk.topics("noread")
    await sk.grant([a for a in _acls_for_worker(t, "noread") if a.name != t.jobs])
    code, seconds, error = await _run_refused(
        worker_settings(sk.bootstrap, t, tiny_llama_dir, security=sk.security("noread")), engine)
    assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, error
    assert f"{t.jobs} (needs READ)" in error, error

    # No READ on the group: refused when the consumer looks for its coordinator, no retry.
    g = await sk.topics("nogroup")
    await sk.grant([a for a in _acls_for_worker(g, "noread") if a.resource is not ResourceType.GROUP])
    code, seconds, error = await _run_refused(
        worker_settings(sk.bootstrap, g, tiny_llama_dir, security=sk.security("noread")), engine)
    assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, error
    assert f"consumer group {g.group}" in error, error

    # Describe but no Read on the jobs topic: the group is joined, the refusal comes with the
    # partition's first fetch, and stops the worker there just the same.
    d = await sk.topics("describeonly")
    await sk.grant([a for a in _acls_for_worker(d, "noread") if a.name != d.jobs]
                   + [Acl("User:noread", ResourceType.TOPIC, d.jobs, Operation.DESCRIBE)])
    code, seconds, error = await _run_refused(
        worker_settings(sk.bootstrap, d, tiny_llama_dir, security=sk.security("noread")), engine)
    assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, error
    assert f"not authorized for topic {d.jobs}" in error, error

    # --exactly-once without the transactional-id ACLs: refused when the partition is assigned
    # (inside the rebalance callback, whose calls are otherwise retried for minutes).
    x = await sk.topics("notxn")
    await sk.grant(_acls_for_worker(x, "noread"))
    code, seconds, error = await _run_refused(
        worker_settings(sk.bootstrap, x, tiny_llama_dir, security=sk.security("noread"), exactly_once=True), engine)
    assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, error
    assert f"transactional id tokenmill.{x.group}.{x.jobs}.0" in error, error

    # The clients: the worker's principal may not write jobs, nor read results.
    (tmp_path / "jobs.jsonl").write_text(json.dumps(job(0)) + "\n")
    as_worker = ["--bootstrap-servers", sk.bootstrap, *sk.flags("noread")]
    for argv in (["produce", str(tmp_path / "jobs.jsonl"), *as_worker, "--jobs-topic", g.jobs, "--no-progress"],
                 ["tail", *as_worker, "--results-topic", g.results, "--from-beginning", "--idle-timeout", "60"]):
        code, seconds = await _cli(*argv)
        line = _one_error_line(capsys.readouterr().err, f"tokenmill {argv[0]}")
        assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, line
        assert "not authorized for topic" in line, line


async def test_a_worker_that_may_not_write_results_stops_with_77_and_commits_nothing(secure_kafka, engine,
                                                                                    tiny_llama_dir):
    sk = secure_kafka
    t = await sk.topics("nowrite")
    # Describe on the results topic (so the start-up check passes), but no Write.
    await sk.grant([a for a in _acls_for_worker(t, "noread") if a.name != t.results or a.operation is not
                    Operation.WRITE])
    producer = AIOKafkaProducer(bootstrap_servers=sk.bootstrap, acks="all", **sk.options("admin"))
    await producer.start()
    try:
        await producer.send_and_wait(t.jobs, json.dumps(job(0)).encode(), key=b"job-00000")
    finally:
        await producer.stop()
    code, seconds, error = await _run_refused(
        worker_settings(sk.bootstrap, t, tiny_llama_dir, security=sk.security("noread")), engine)
    assert code == EXIT_NOT_AUTHORIZED and seconds < FAST_S, error
    assert f"not authorized for topic {t.results}" in error, error
    group = AIOKafkaConsumer(bootstrap_servers=sk.bootstrap, group_id=t.group, enable_auto_commit=False,
                             **sk.options("admin"))
    await group.start()
    try:
        # Not past the job (a commit at 0 carries its crash attempt): it runs again once allowed.
        assert await group.committed(TopicPartition(t.jobs, 0)) in (None, 0)
    finally:
        await group.stop()


async def _first_batch(consumer: AIOKafkaConsumer) -> None:
    await consumer.start()
    try:
        for _ in range(25):
            await consumer.getmany(timeout_ms=200)
    finally:
        await consumer.stop()


async def test_the_worker_principal_reads_jobs_writes_outputs_and_nothing_else(secure_kafka):
    sk = secure_kafka
    other = f"other-{uuid.uuid4().hex[:8]}"
    t = await sk.topics("scope", extra=[other])
    acls = _acls_for_worker(t, exactly_once=True)
    await sk.grant(acls)
    opts = sk.options("worker")
    names = {t.jobs, t.results, t.tokens, t.dlq, t.group, "kafka-cluster", f"tokenmill.{t.group}."}
    on_broker = [a for a in await list_acls(sk.bootstrap, "worker", sk.options("admin")) if a.name in names]
    assert on_broker == sorted(acls)

    producer = AIOKafkaProducer(bootstrap_servers=sk.bootstrap, acks="all", enable_idempotence=True, **opts)
    await producer.start()
    try:
        for topic in (t.results, t.tokens, t.dlq):
            await producer.send_and_wait(topic, b"{}", key=b"allowed")
        for topic in (t.jobs, other):
            with pytest.raises(TopicAuthorizationFailedError):
                await asyncio.wait_for(producer.send_and_wait(topic, b"{}", key=b"refused"), 20)
    finally:
        await producer.stop()

    # Reading the jobs topic by hand is allowed; reading an output or another topic is not.
    allowed = AIOKafkaConsumer(bootstrap_servers=sk.bootstrap, group_id=None, **opts)
    allowed.assign([TopicPartition(t.jobs, 0)])
    await asyncio.wait_for(_first_batch(allowed), 30)
    for topic in (t.results, other):
        refused = AIOKafkaConsumer(bootstrap_servers=sk.bootstrap, group_id=None, auto_offset_reset="earliest",
                                   **opts)
        refused.assign([TopicPartition(topic, 0)])
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(_first_batch(refused), 30)
    # Another group, or a transactional id outside the worker's prefix.
    stranger = AIOKafkaConsumer(t.jobs, bootstrap_servers=sk.bootstrap, group_id=f"{t.group}-other", **opts)
    with pytest.raises(GroupAuthorizationFailedError):
        await asyncio.wait_for(_first_batch(stranger), 30)
    txn = AIOKafkaProducer(bootstrap_servers=sk.bootstrap, transactional_id=f"other.{t.group}.0", **opts)
    with pytest.raises(TransactionalIdAuthorizationFailed):
        await asyncio.wait_for(txn.start(), 30)
    await txn.stop()
    # Exactly-once ids of its own group are allowed.
    own = AIOKafkaProducer(bootstrap_servers=sk.bootstrap, transactional_id=f"tokenmill.{t.group}.{t.jobs}.0",
                           **opts)
    await asyncio.wait_for(own.start(), 30)
    await own.stop()


def _script_acls(env: dict[str, str]) -> list[list[str]]:
    """The rules deploy/kafka/acls.sh creates, as kafka-acls arguments (after `--add`)."""
    out = subprocess.run(["bash", str(REPO / "deploy" / "kafka" / "acls.sh"), "--dry-run"], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout
    return sorted(shlex.split(line)[2:] for line in out.splitlines())


@pytest.mark.parametrize("exactly_once, produce_topic", [(True, "tokenmill.jobs.{model}"), (False, "jobs-all")])
def test_the_deploy_acls_script_grants_exactly_the_lists_of_each_role(exactly_once, produce_topic):
    env = dict(WORKER_PRINCIPAL="User:w", PRODUCER_PRINCIPAL="User:p", READER_PRINCIPAL="User:r",
               BACKFILL_PRINCIPAL="User:b", GROUP_ID="g1", JOBS_TOPIC="jobs.g1", PRODUCE_JOBS_TOPIC=produce_topic,
               RESULTS_TOPIC="res", TOKENS_TOPIC="tok", DLQ_TOPIC="dlq", EXACTLY_ONCE=str(exactly_once).lower())
    expected = (worker_acls("User:w", group_id="g1", jobs_topic="jobs.g1", results_topic="res", tokens_topic="tok",
                            dlq_topic="dlq", exactly_once=exactly_once)
                + producer_acls("User:p", produce_topic) + reader_acls("User:r", ["res", "tok"])
                + backfill_acls("User:b", produce_topic, "res"))
    assert _script_acls(env) == sorted(acl.kafka_acls_args() for acl in expected)
