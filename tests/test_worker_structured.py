"""The worker with structured output, against the real broker (in-process, one shared tiny engine).

Jobs carrying sampling.structured_outputs (every kind) give ok Results whose text keeps the
constraint; a job whose schema does not compile gives an error Result with code
invalid_constraint and the library's reason, plus its dead letter; the worker stays up and goes on
with the jobs sent after it, and the committed offset reaches the end of the partition.
"""

from __future__ import annotations

import json

import pytest

from tests.structured_helpers import output_problem
from tests.worker_helpers import (
    committed_offsets,
    count_unique_jobs,
    end_offsets,
    job,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    running_worker,
    wait_for,
    worker_settings,
)
from tokenmill.engine.types import StructuredOutputsParams
from tokenmill.schemas.constants import ERROR_INVALID_CONSTRAINT
from tokenmill.tools.structured_workload import SCHEMAS

pytestmark = [pytest.mark.kafka]

CONSTRAINTS = [
    *({"json": s.schema} for s in SCHEMAS),
    {"json_object": True},
    {"regex": "[a-z]{2,6}-[0-9]{3}"},
    {"choice": ["positive", "negative", "neutral"]},
    {"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'},
]
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "strin"}}}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tokenmill.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=64, max_num_batched_tokens=1024,
                               kv_cache_gb=0.05))


def compiles_seen(worker) -> int:
    """Constraint compiles the worker's Prometheus histogram observed (cache hits are not compiles)."""
    return int(next(s.value for m in worker.metrics.constraint_compile.collect() for s in m.samples
                    if s.name.endswith("_count")))


def structured_job(i: int, constraint: dict, **extra) -> dict:
    body = job(i, ("prompt", "messages", "tokens")[i % 3], max_tokens=160, stream=(i % 5 == 0), **extra)
    body["sampling"].update(ignore_eos=False, structured_outputs=constraint)
    return body


async def test_constrained_jobs_are_valid_and_a_bad_schema_is_an_invalid_constraint_error(
        kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "structured", partitions=1)
    first = [structured_job(i, CONSTRAINTS[i % len(CONSTRAINTS)]) for i in range(26)]
    bad = structured_job(900, {"json": BAD_SCHEMA})
    first.insert(13, bad)
    later = [structured_job(100 + i, CONSTRAINTS[i % len(CONSTRAINTS)]) for i in range(13)]
    valid = [j for j in first + later if j is not bad]
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir)
    async with running_worker(settings, engine) as (w, task):
        await produce(kafka_bootstrap, topics.jobs, first, partition=0)
        await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(len(first)), timeout=120)
        assert not task.done()  # the bad schema did not take the worker down
        await produce(kafka_bootstrap, topics.jobs, later, partition=0)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(len(first) + len(later)),
                                   timeout=120)
        dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 1, timeout=30)
        end = (await end_offsets(kafka_bootstrap, topics.jobs, 1))[0]

        async def committed_to_end():
            return (await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1))[0] == end

        await wait_for(committed_to_end, 60, what="the committed offset at the end of the partition")
        failures = w.metrics.jobs_error.labels(ERROR_INVALID_CONSTRAINT)._value.get()
        compiles = compiles_seen(w)
        assert not task.done()
    assert task.result() == 0
    results = results_by_job(records)
    assert sorted(results) == sorted(j["job_id"] for j in first + later)
    assert all(len(v) == 1 for v in results.values())

    # The bad schema: an error Result with the library's reason, and its dead letter.
    (res,) = results[bad["job_id"]]
    assert res["status"] == "error" and res["error"]["code"] == ERROR_INVALID_CONSTRAINT, res
    assert "Invalid type: strin" in res["error"]["message"]
    assert res["text"] == "" and res["token_ids"] == []
    assert len(dlq) == 1
    headers = {k: v.decode() for k, v in dlq[0].headers}
    assert headers["tokenmill.error.code"] == ERROR_INVALID_CONSTRAINT and headers["tokenmill.error.message"]
    assert json.loads(dlq[0].value) == bad
    assert headers["tokenmill.source.offset"] == str(first.index(bad))
    assert failures == 1
    assert 1 <= compiles <= len(CONSTRAINTS) + 1  # one per distinct constraint at most: the rest from the cache

    # Every valid job: an ok Result whose text keeps its constraint (when the grammar completed).
    stops = 0
    for j in valid:
        (res,) = results[j["job_id"]]
        assert res["status"] == "ok", res
        assert res["finish_reason"] in ("stop", "length")
        if res["finish_reason"] == "stop":
            stops += 1
            constraint = StructuredOutputsParams(**j["sampling"]["structured_outputs"])
            problem = output_problem(constraint, res["text"], tiny_llama_dir, res["token_ids"])
            assert problem is None, (j["job_id"], problem)
    assert stops >= len(valid) // 2


async def test_the_same_bad_schema_again_fails_from_the_cache_and_the_worker_goes_on(
        kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "structured-again", partitions=1)
    jobs = [structured_job(i, {"json": BAD_SCHEMA} if i % 2 else CONSTRAINTS[i % len(CONSTRAINTS)])
            for i in range(10)]
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir)
    async with running_worker(settings, engine) as (w, task):
        await produce(kafka_bootstrap, topics.jobs, jobs, partition=0)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(len(jobs)), timeout=120)
        dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 5, timeout=30)
        compiles = compiles_seen(w)
        assert not task.done()
    assert task.result() == 0
    results = results_by_job(records)
    for i, j in enumerate(jobs):
        (res,) = results[j["job_id"]]
        assert res["status"] == ("error" if i % 2 else "ok"), res
        if i % 2:
            assert res["error"]["code"] == ERROR_INVALID_CONSTRAINT
    assert len(dlq) == 5
    assert {k: v.decode() for k, v in dlq[0].headers}["tokenmill.error.code"] == ERROR_INVALID_CONSTRAINT
    distinct = {json.dumps(j["sampling"]["structured_outputs"], sort_keys=True) for j in jobs}
    assert compiles <= len(distinct)  # the bad schema compiled once at most, not once per job
