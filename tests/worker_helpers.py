"""Helpers for the worker tests: topics, producing jobs, reading answers, running workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tests import worker_launcher
from tokenmill.kafka.admin import create_topic

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Topics:
    jobs: str
    results: str
    tokens: str
    dlq: str
    group: str

    def flags(self) -> list[str]:
        return ["--jobs-topic", self.jobs, "--results-topic", self.results, "--tokens-topic", self.tokens,
                "--dlq-topic", self.dlq, "--group-id", self.group]


async def make_topics(bootstrap: str, stem: str, partitions: int = 1) -> Topics:
    import uuid

    tag = f"{stem}-{uuid.uuid4().hex[:8]}"
    t = Topics(f"jobs-{tag}", f"results-{tag}", f"tokens-{tag}", f"dlq-{tag}", f"group-{tag}")
    for name, n in ((t.jobs, partitions), (t.results, 1), (t.tokens, 1), (t.dlq, partitions)):
        await create_topic(bootstrap, name, n)
    return t


def job(i: int, form: str = "prompt", stream: bool = False, max_tokens: int = 6, **extra) -> dict:
    body: dict = {"job_id": f"job-{i:05d}", "sampling": {"max_tokens": max_tokens, "temperature": 0.0,
                                                          "ignore_eos": True}, "stream": stream}
    if form == "prompt":
        body["prompt"] = f"Tell me about item number {i}"
    elif form == "messages":
        body["messages"] = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": f"Summarise record {i}"}]
    elif form == "tokens":
        body["prompt_token_ids"] = [10 + (i % 50), 20, 30 + (i % 7), 40]
    else:
        raise ValueError(form)
    body.update(extra)
    return body


async def produce(bootstrap: str, topic: str, values: list, partition: int | None = None,
                  keys: list | None = None) -> None:
    """Send values (dict -> JSON, bytes as they are, None as a tombstone) and wait for all acks."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5)
    await producer.start()
    try:
        futures = []
        for i, v in enumerate(values):
            raw = json.dumps(v).encode() if isinstance(v, dict) else v
            key = keys[i] if keys else None
            futures.append(await producer.send(topic, value=raw, key=key, partition=partition))
        for f in futures:
            await f
    finally:
        await producer.stop()


async def read_topic(bootstrap: str, topic: str, until: Callable[[list], bool], timeout: float,
                     read_committed: bool = False) -> list:
    """Read every record from the start until until(records) is true or timeout; returns records."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None,
                                isolation_level="read_committed" if read_committed else "read_uncommitted")
    await consumer.start()
    records: list = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for recs in batch.values():
                records.extend(recs)
            if until(records):
                break
    finally:
        await consumer.stop()
    return records


def results_by_job(records) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        res = json.loads(r.value)
        out.setdefault(res["job_id"], []).append(res)
    return out


def count_unique_jobs(n: int) -> Callable[[list], bool]:
    def done(records) -> bool:
        return len({r.key for r in records}) >= n
    return done


async def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        out = {}
        for p in range(partitions):
            out[p] = await consumer.committed(TopicPartition(topic, p))
        return out
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        await consumer.stop()


async def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


# -- workers ---------------------------------------------------------------------------------------
def worker_settings(bootstrap: str, topics: Topics, model_dir: str, **over):
    """Settings for an in-process worker, tuned for 2 CPU cores and quick tests."""
    from tokenmill.config import WorkerSettings
    from tokenmill.engine.config import EngineConfig

    s = WorkerSettings(
        bootstrap_servers=bootstrap,
        engine=EngineConfig(model=str(model_dir), max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_gb=0.05),
        group_id=topics.group, jobs_topic=topics.jobs, results_topic=topics.results,
        tokens_topic=topics.tokens, dlq_topic=topics.dlq, commit_interval_s=0.2, session_timeout_ms=6000,
        heartbeat_interval_ms=1000, drain_timeout_s=20, revoke_grace_s=1.0,
    )
    for k, v in over.items():
        setattr(s, k, v)
    return s


@contextlib.asynccontextmanager
async def running_worker(settings, engine):
    """An in-process KafkaWorker on a shared engine; stopped (drained) on exit."""
    from tokenmill.kafka.worker import KafkaWorker
    from tokenmill.logging import configure_logging

    configure_logging("WARNING")
    w = KafkaWorker(settings, engine=engine)
    task = asyncio.create_task(w.run(install_signal_handlers=False))
    try:
        await wait_for(lambda: w.health.group_joined or task.done(), 60, what="group join")
        if task.done():
            task.result()
        yield w, task
    finally:
        w.request_stop("test done")
        await asyncio.wait_for(task, 60)


def worker_command(bootstrap: str, topics: Topics, model_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "worker", "--bootstrap-servers", bootstrap, "--model", str(model_dir),
            *topics.flags(), "--max-num-seqs", "64", "--max-num-batched-tokens", "1024", "--kv-cache-gb", "0.05",
            "--commit-interval", "0.2", "--session-timeout-ms", "6000", "--revoke-grace", "1",
            "--log-level", "WARNING", *extra]


def start_worker_process(cmd: list[str], log_path: Path, fresh_interpreter: bool = False):
    """Start `cmd` in a session of its own, its output appended to log_path; returns a Popen or a
    ForkedProcess (the same methods): `python -m` commands are forked from a process that has
    imported torch already (tests/worker_launcher.py says why and what differs), unless
    fresh_interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    return worker_launcher.start_process(cmd, env, log_path, fresh_interpreter)


def stop_process(proc, sig=signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


class FakeEngineThread:
    """Stands in for the engine thread in unit tests of the worker's steps: records what it is asked."""

    alive = True

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, request, every_delta: bool = False) -> None:
        self.submitted.append(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


# -- a worker process seen from outside: its HTTP endpoints and its log ------------------------------
def log_tail(path: Path, n: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def worker_metrics(port: int) -> dict[str, float]:
    """The unlabelled samples of a worker's /metrics, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not name.startswith("#") and "{" not in name:
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def worker_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


async def wait_ready(proc, port: int, log: Path, timeout: float = 120, interval: float = 0.3) -> None:
    """Until the worker process answers /readyz; fails with its log if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited: {log_tail(log)}"
        if await asyncio.to_thread(worker_ready, port):
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"worker not ready within {timeout}s: {log_tail(log)}")
