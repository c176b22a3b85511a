"""Output topics that will not take every record, against the real broker: Results over the
results topic's max.message.bytes (cut down, or replaced by a `result_too_large` error) and a
tokens topic that refuses every TokenEvent never hold a partition back; the producer follows the
topics' limits; a record whose job_id can be read gets its error Result under that id."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from tests.worker_helpers import (
    Topics,
    committed_offsets,
    count_unique_jobs,
    end_offsets,
    job,
    produce,
    read_topic,
    results_by_job,
    running_worker,
    wait_for,
    worker_settings,
)
from tokenmill.kafka.admin import create_topic

pytestmark = [pytest.mark.kafka]

WORKER = "w-limits"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tokenmill.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=64, max_num_batched_tokens=1024,
                               kv_cache_gb=0.05))


def _names(stem: str) -> Topics:
    import uuid

    tag = f"{stem}-{uuid.uuid4().hex[:8]}"
    return Topics(f"jobs-{tag}", f"results-{tag}", f"tokens-{tag}", f"dlq-{tag}", f"group-{tag}")


async def _topics(bootstrap: str, stem: str | Topics, results_config: dict | None = None,
                  tokens_config: dict | None = None) -> Topics:
    t = _names(stem) if isinstance(stem, str) else stem
    await create_topic(bootstrap, t.jobs, 1)
    await create_topic(bootstrap, t.results, 1, results_config)
    await create_topic(bootstrap, t.tokens, 1, tokens_config)
    await create_topic(bootstrap, t.dlq, 1)
    return t


async def _committed_to_end(bootstrap: str, topics: Topics, timeout: float) -> float:
    """Seconds until the group's committed offset reached the end of the jobs partition."""
    end = (await end_offsets(bootstrap, topics.jobs, 1))[0]
    t0 = time.monotonic()

    async def at_end():
        return (await committed_offsets(bootstrap, topics.group, topics.jobs, 1))[0] == end

    await wait_for(at_end, timeout, what="the commit point to pass every job")
    return time.monotonic() - t0


def _full_outputs(engine, bodies: list[dict]):
    from tokenmill.job_mapping import job_to_engine_request
    from tokenmill.schemas import Job

    return engine.generate([job_to_engine_request(Job.model_validate(b)) for b in bodies])


def _bare_size(engine, body: dict, delta, topics: Topics, offset: int) -> int:
    """The size the worker's Result of this job would have without logprobs and text (timings at
    their longest: the worker's own are shorter)."""
    from tokenmill.job_mapping import build_result
    from tokenmill.kafka.answers import source_of
    from tokenmill.kafka.publisher import record_size
    from tokenmill.schemas import Job, Timing

    result = build_result(Job.model_validate(body), delta, model=engine.served_model_name, worker=WORKER,
                          attempt=f"{WORKER}-{'0' * 12}", source=source_of(topics.jobs, 0, offset))
    long = 123456.78901234567
    bare = result.model_copy(update={"text": "", "logprobs": None, "truncated": True,
                                     "timing": Timing(queue_ms=long, ttft_ms=long, decode_ms=long, total_ms=long)})
    return record_size(body["job_id"].encode(), bare.to_json_bytes())


async def test_results_over_the_size_limit_are_cut_down_or_replaced_and_the_partition_moves_on(
        kafka_bootstrap, tiny_llama_dir, engine):
    logprobs_job = job(1, max_tokens=20)
    logprobs_job["sampling"]["logprobs"] = 5
    text_job, error_job = job(3, max_tokens=200), job(5, max_tokens=600)
    full = _full_outputs(engine, [logprobs_job, text_job, error_job])
    # The limit: the text job fits without its text, not with all of it; the error job's token ids
    # alone pass it; the logprobs job fits once its logprobs are gone.
    text_bytes = len(json.dumps(full[text_job["job_id"]].output_text, ensure_ascii=False).encode())
    topics = _names("limits")
    limit = _bare_size(engine, text_job, full[text_job["job_id"]], topics, 3) + text_bytes // 2
    assert _bare_size(engine, error_job, full[error_job["job_id"]], topics, 5) > limit + 500
    assert _bare_size(engine, logprobs_job, full[logprobs_job["job_id"]], topics, 1) + 500 < limit
    await _topics(kafka_bootstrap, topics, {"max.message.bytes": str(limit)})
    bodies = [job(0, max_tokens=4), logprobs_job, job(2, max_tokens=4), text_job, job(4, max_tokens=4), error_job,
              job(6, max_tokens=4), job(7, max_tokens=4, stream=True)]
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, worker_name=WORKER)
    async with running_worker(settings, engine) as (w, task):
        assert w.limits.of(topics.results) == limit and w.limits.of(topics.tokens) == 1_048_588
        t0 = time.monotonic()
        await produce(kafka_bootstrap, topics.jobs, bodies)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(len(bodies)), timeout=60)
        answered_s = time.monotonic() - t0
        commit_s = await _committed_to_end(kafka_bootstrap, topics, timeout=15)
        dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 1, timeout=10)
        cuts = {how: w.metrics.records_cut.labels(how)._value.get() for how in ("logprobs", "text", "result_too_large")}
    assert task.result() == 0
    assert answered_s < 60 and commit_s < 15, (answered_s, commit_s)
    assert all(len(r.key) + len(r.value) <= limit for r in records)
    results = {job_id: rs[0] for job_id, rs in results_by_job(records).items()}
    assert all(len(rs) == 1 for rs in results_by_job(records).values())

    lp = results[logprobs_job["job_id"]]
    assert lp["status"] == "ok" and lp["truncated"] is True and "logprobs" not in lp
    assert lp["text"] == full[logprobs_job["job_id"]].output_text and len(lp["token_ids"]) == 20

    cut = results[text_job["job_id"]]
    whole_text = full[text_job["job_id"]].output_text
    assert cut["status"] == "ok" and cut["truncated"] is True
    assert cut["token_ids"] == list(full[text_job["job_id"]].output_token_ids)
    assert 0 < len(cut["text"]) < len(whole_text) and whole_text.startswith(cut["text"])

    err = results[error_job["job_id"]]
    assert err["status"] == "error" and err["error"]["code"] == "result_too_large"
    assert err["usage"]["completion_tokens"] == 600 and "truncated" not in err
    (dead,) = dlq
    assert dict(dead.headers)["tokenmill.error.code"] == b"result_too_large"
    assert json.loads(dead.value) == error_job  # the input, unchanged, to run again elsewhere

    for body in bodies:
        if body["job_id"] not in (logprobs_job["job_id"], text_job["job_id"], error_job["job_id"]):
            assert results[body["job_id"]]["status"] == "ok" and "truncated" not in results[body["job_id"]]
    assert cuts == {"logprobs": 1, "text": 1, "result_too_large": 1}


async def _set_topic_config(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, config)])
    finally:
        await admin.close()


async def test_a_tokens_topic_that_refuses_every_event_holds_no_job_back(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await _topics(kafka_bootstrap, "tokens-refused")
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, worker_name=WORKER)
    async with running_worker(settings, engine) as (w, task):
        first = [job(i, max_tokens=4, stream=True) for i in range(4)]
        await produce(kafka_bootstrap, topics.jobs, first)
        await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(4), timeout=60)
        assert w.tokens.dropped == 0
        # The limit falls under a running worker (it read 1 MiB at start): the broker refuses.
        await _set_topic_config(kafka_bootstrap, topics.tokens, {"max.message.bytes": "120"})
        await asyncio.sleep(1.0)
        later = [job(10 + i, max_tokens=6, stream=(i % 2 == 0)) for i in range(10)]
        t0 = time.monotonic()
        await produce(kafka_bootstrap, topics.jobs, later)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(14), timeout=60)
        answered_s = time.monotonic() - t0
        await _committed_to_end(kafka_bootstrap, topics, timeout=15)
        # ... and jobs after those still stream nothing but finish.
        last = [job(30 + i, max_tokens=4, stream=True) for i in range(3)]
        await produce(kafka_bootstrap, topics.jobs, last)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(17), timeout=60)
        await _committed_to_end(kafka_bootstrap, topics, timeout=15)
        dropped = sum(w.metrics.token_events_dropped.labels(r)._value.get() for r in ("too_large", "invalid"))
        refused = w.metrics.publish_refused.labels("too_large")._value.get()
    assert task.result() == 0
    results = results_by_job(records)
    assert len(results) == 17 and all(rs[0]["status"] == "ok" for rs in results.values())
    assert answered_s < 60
    # 8 streaming jobs after the change, each with at least 4 events: all dropped, counted.
    assert dropped == w.tokens.dropped >= 8 * 4
    assert refused == 0  # nothing of the results topic was refused
    events = await read_topic(kafka_bootstrap, topics.tokens, lambda r: False, timeout=1.5)
    assert {json.loads(e.value)["job_id"] for e in events} == {b["job_id"] for b in first}


async def test_the_producer_follows_the_topic_limits_read_at_start(kafka_bootstrap, new_topic):
    from tokenmill.config import WorkerSettings
    from tokenmill.engine.config import EngineConfig
    from tokenmill.kafka import clients
    from tokenmill.logging import get_logger

    small, default = new_topic(config={"max.message.bytes": "5000"}), new_topic()
    s = WorkerSettings(bootstrap_servers=kafka_bootstrap, engine=EngineConfig(model="m"), results_topic=small,
                       tokens_topic=default, dlq_topic="no-such-topic-anywhere")
    limits = await clients.read_topic_limits(s, get_logger("test"))
    assert limits.by_topic == {small: 5000, default: 1_048_588} and limits.unread == ("no-such-topic-anywhere",)
    assert limits.producer_kwargs() == {"max_request_size": 1_048_588, "max_batch_size": 5000}
    producer = clients.new_producer(s, limits)
    assert producer.main._max_request_size == 1_048_588


async def test_a_broker_refusal_moves_the_topic_to_the_plain_producer_and_later_records_go_through(
        kafka_bootstrap, new_topic):
    """aiokafka's idempotent producer loses a partition's sequence after a refused batch (every
    later batch is refused as out of order); the worker's producer sends that topic through a
    plain producer from then on."""
    from tokenmill.kafka.publisher import OutRecord, WorkerProducer, send_acked

    topic = new_topic(config={"max.message.bytes": "2000"})
    kwargs = dict(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=2, max_request_size=1 << 20)
    switched: list[str] = []
    producer = WorkerProducer(AIOKafkaProducer(enable_idempotence=True, **kwargs),
                              lambda: AIOKafkaProducer(enable_idempotence=False, **kwargs),
                              on_switch=lambda t, exc: switched.append(t))
    await producer.start()
    try:
        small = OutRecord(topic, b"k", b"s" * 100)
        big = OutRecord(topic, b"k", b"b" * 3000, shrink=lambda refused: OutRecord(topic, b"k", b"cut" * 10))
        for rec in (small, big, small, small):
            await asyncio.wait_for(send_acked(producer, rec, max_backoff_s=0.05), 30)
    finally:
        await producer.stop()
    assert switched == [topic]
    values = [r.value for r in await read_topic(kafka_bootstrap, topic, lambda r: len(r) >= 4, timeout=10)]
    assert values == [b"s" * 100, b"cut" * 10, b"s" * 100, b"s" * 100]


async def test_a_job_whose_id_can_be_read_gets_an_error_result_under_it(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await _topics(kafka_bootstrap, "readable-id")
    surrogate = b'{"job_id": "sur-1", "prompt": "a lone \\ud800 surrogate", "sampling": {"max_tokens": 2}}'
    values = [surrogate, json.dumps(job(1, max_tokens=3)).encode()]
    await produce(kafka_bootstrap, topics.jobs, values)
    async with running_worker(worker_settings(kafka_bootstrap, topics, tiny_llama_dir), engine) as (w, task):
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(2), timeout=60)
        dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 1, timeout=10)
        await _committed_to_end(kafka_bootstrap, topics, timeout=15)
    assert task.result() == 0
    results = results_by_job(records)
    (err,) = results["sur-1"]
    assert err["status"] == "error" and err["error"]["code"] == "invalid_job"
    assert "surrogate" in err["error"]["message"] and err["source"]["offset"] == 0
    assert [r["status"] for r in results["job-00001"]] == ["ok"]
    (dead,) = dlq
    assert dead.value == surrogate and dict(dead.headers)["tokenmill.error.code"] == b"invalid_job"


async def test_exactly_once_stages_results_already_cut_down_to_the_limit(kafka_bootstrap, tiny_llama_dir, engine):
    """A transaction with a record the broker refuses would fail on every try: with --exactly-once
    the Results are cut down before they are staged."""
    topics = await _topics(kafka_bootstrap, "limits-eos", {"max.message.bytes": "3000"})
    big = job(1, max_tokens=30)
    big["sampling"]["logprobs"] = 5  # about 10 KB of logprobs
    bodies = [job(0, max_tokens=4), big, job(2, max_tokens=4)]
    await produce(kafka_bootstrap, topics.jobs, bodies)
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, exactly_once=True)
    async with running_worker(settings, engine) as (w, task):
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(3), timeout=60,
                                   read_committed=True)
        await _committed_to_end(kafka_bootstrap, topics, timeout=15)
    assert task.result() == 0
    results = {job_id: rs for job_id, rs in results_by_job(records).items()}
    assert [len(rs) for rs in results.values()] == [1, 1, 1]
    (cut,) = results[big["job_id"]]
    assert cut["status"] == "ok" and cut["truncated"] is True and "logprobs" not in cut
    assert len(cut["token_ids"]) == 30
