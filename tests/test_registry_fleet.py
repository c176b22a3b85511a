"""Schema Registry end to end: a real worker process with --schema-registry on the real broker and
a real registry (Apicurio, the session fixture), fed and read by tokenmill's own clients.

Framed Jobs go in (`tokenmill produce`, and one framed by confluent-kafka's own serializer) and
framed Results come out that confluent-kafka's deserializers read: JSON Schema, and Avro with
--result-format avro (the fixture runs the module once per format, one worker at a time). A Job
framed with a schema id the registry does not know is dead-lettered with that reason, and gets an
error Result only when its job_id can be read. `tokenmill tail`, backfill's Kafka backend and
eval's Kafka runner read the framed Results (and TokenEvents) the worker writes."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.fixtures.registry import confluent_client
from tests.worker_helpers import (
    Topics,
    make_topics,
    produce,
    read_topic,
    start_worker_process,
    stop_process,
    worker_command,
)
from tokenmill.cli import main as tokenmill
from tokenmill.kafka.local_broker import free_port
from tokenmill.kafka.registry import DEAD_LETTER_HEADER, RegistrySettings, value_subject
from tokenmill.schemas import Job, Result, Sampling, TokenEvent
from tokenmill.schemas.avro import AvroResults
from tokenmill.schemas.export import render
from tokenmill.schemas.wire import frame

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

JOB_PARTITIONS = 2


@dataclass
class RegistryFleet:
    bootstrap: str
    registry: str  # the registry's Confluent API URL
    topics: Topics
    result_format: str  # json | avro
    model: str  # the served model name
    model_dir: str  # its checkpoint (eval reads its tokenizer)

    def confluent(self) -> SchemaRegistryClient:
        return confluent_client(self.registry)

    def result_of(self, value: bytes) -> Result:
        """A Result record as confluent-kafka's own deserializer of the worker's format reads it."""
        ctx = SerializationContext(self.topics.results, MessageField.VALUE)
        if self.result_format == "avro":
            record = AvroDeserializer(self.confluent())(value, ctx)
            return Result.model_validate(AvroResults().from_avro(record))
        return Result.model_validate(JSONDeserializer(None, schema_registry_client=self.confluent())(value, ctx))

    def json_of(self, topic: str, value: bytes) -> dict:
        """A record framed with a JSON Schema, read by confluent-kafka's JSON Schema deserializer."""
        deserializer = JSONDeserializer(None, schema_registry_client=self.confluent())
        return deserializer(value, SerializationContext(topic, MessageField.VALUE))


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            if r.status != 200:
                return False
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            metrics = r.read().decode()
    except OSError:
        return False
    return f"tokenmill_partitions_assigned {float(JOB_PARTITIONS)}" in metrics


@pytest.fixture(scope="module", params=["json", "avro"])
def fleet(request, kafka_bootstrap, schema_registry, tiny_llama_dir, tmp_path_factory):
    fmt = request.param
    tmp = tmp_path_factory.mktemp(f"registry-fleet-{fmt}")
    topics = asyncio.run(make_topics(kafka_bootstrap, f"registry-{fmt}", partitions=JOB_PARTITIONS))
    port = free_port()
    log = tmp / "worker.log"
    cmd = worker_command(kafka_bootstrap, topics, str(tiny_llama_dir), "--metrics-port", str(port),
                         "--schema-registry", schema_registry, "--result-format", fmt)
    proc = start_worker_process(cmd, log)
    try:
        deadline = time.monotonic() + 180
        while not _ready(port):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the worker did not start serving: {log.read_text()[-3000:]}"
            time.sleep(0.3)
        yield RegistryFleet(kafka_bootstrap, schema_registry, topics, fmt, Path(tiny_llama_dir).name,
                            str(tiny_llama_dir))
    finally:
        code = stop_process(proc)
        assert code == 0, log.read_text()[-3000:]


def _records(fleet: RegistryFleet, topic: str, keys: set[bytes], timeout: float = 120) -> dict[bytes, list]:
    """The records of ``topic`` under ``keys``, once every key has one."""
    found = asyncio.run(read_topic(fleet.bootstrap, topic, lambda recs: keys <= {r.key for r in recs}, timeout))
    out: dict[bytes, list] = {}
    for rec in found:
        if rec.key in keys:
            out.setdefault(rec.key, []).append(rec)
    assert set(out) == keys, f"no record for {sorted(keys - set(out))} on {topic}"
    return out


def _job(job_id: str, i: int, stream: bool = False) -> dict:
    return {"job_id": job_id, "prompt": f"Tell me about item {i}", "stream": stream,
            "sampling": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}}


def test_framed_jobs_in_framed_results_out_and_an_unknown_schema_id_is_dead_lettered(fleet, tmp_path, capsys):
    tag = uuid.uuid4().hex[:8]
    jobs_topic = fleet.topics.jobs
    produced = [_job(f"{tag}-p{i}", i, stream=i % 2 == 0) for i in range(6)]
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in produced))
    assert tokenmill(["produce", str(tmp_path / "jobs.jsonl"), "--bootstrap-servers", fleet.bootstrap,
                      "--jobs-topic", jobs_topic, "--schema-registry", fleet.registry, "--no-progress"]) == 0
    # The Job schema tokenmill produce registered under the topic-name strategy's subject.
    job_schema = fleet.confluent().get_latest_version(value_subject(jobs_topic))
    assert json.loads(job_schema.schema.schema_str) == json.loads(render("job"))
    unknown_id = job_schema.schema_id + 1_000_000
    # One Job framed by confluent-kafka's own serializer, one plain JSON Job, and two framed with a
    # schema id the registry does not know: one whose payload still names its job_id, one that does not.
    serializer = JSONSerializer(render("job"), fleet.confluent(),
                                conf={"auto.register.schemas": False, "use.latest.version": True})
    by_confluent = serializer(_job(f"{tag}-c", 7), SerializationContext(jobs_topic, MessageField.VALUE))
    readable = frame(unknown_id, json.dumps({"job_id": f"{tag}-unknown", "prompt": "hi"}).encode())
    unreadable = frame(unknown_id, b"\x02\x08no json here")
    asyncio.run(produce(fleet.bootstrap, jobs_topic, [by_confluent, _job(f"{tag}-plain", 8), readable, unreadable],
                        keys=[f"{tag}-c".encode(), f"{tag}-plain".encode(), f"{tag}-unknown".encode(),
                              f"{tag}-nothing".encode()]))

    # Every Job tokenmill produce wrote is framed, and confluent-kafka's deserializer reads it back.
    sent = _records(fleet, jobs_topic, {j["job_id"].encode() for j in produced})
    for job in produced:
        (rec,) = sent[job["job_id"].encode()]
        assert rec.value[0] == 0 and int.from_bytes(rec.value[1:5], "big") == job_schema.schema_id
        assert fleet.json_of(jobs_topic, rec.value) == job

    answered = [j["job_id"] for j in produced] + [f"{tag}-c", f"{tag}-plain"]
    results = _records(fleet, fleet.topics.results, {k.encode() for k in [*answered, f"{tag}-unknown"]})
    read = {key.decode(): fleet.result_of(recs[0].value) for key, recs in results.items()}
    assert all(recs[0].value[0] == 0 for recs in results.values())  # every Result framed
    for job_id in answered:
        assert read[job_id].status == "ok" and len(read[job_id].token_ids) == 3, read[job_id]
    error = read[f"{tag}-unknown"]
    assert error.status == "error" and error.error.code == "invalid_job"
    assert error.error.message == f"schema id {unknown_id} is not known to the schema registry"

    # Both are dead letters, their values unchanged, the reason in the framed DeadLetter header;
    # the one without a readable job_id has no Result.
    letters = _records(fleet, fleet.topics.dlq, {f"{tag}-unknown".encode(), f"{tag}-nothing".encode()})
    for key, value in ((f"{tag}-unknown", readable), (f"{tag}-nothing", unreadable)):
        (rec,) = letters[key.encode()]
        assert rec.value == value
        info = fleet.json_of(fleet.topics.dlq, dict(rec.headers)[DEAD_LETTER_HEADER])
        assert info["code"] == "invalid_job" and info["source"]["topic"] == jobs_topic
        assert info["message"] == f"schema id {unknown_id} is not known to the schema registry"
    later = asyncio.run(read_topic(fleet.bootstrap, fleet.topics.results, lambda recs: False, timeout=1.0))
    assert f"{tag}-nothing".encode() not in {r.key for r in later}

    # The streamed jobs' TokenEvents, framed with the TokenEvent's JSON Schema, add up to their Results.
    streamed = [j["job_id"] for j in produced if j["stream"]]
    events = _records(fleet, fleet.topics.tokens, {k.encode() for k in streamed})
    for job_id in streamed:
        parts = [TokenEvent.model_validate(fleet.json_of(fleet.topics.tokens, r.value)) for r in events[job_id.encode()]]
        assert "".join(p.text for p in parts) == read[job_id].text and parts[-1].finished

    # tokenmill tail reads the framed Results (and reassembles the framed streams) with the registry.
    ids = [*answered, f"{tag}-unknown"]
    base = ["tail", "--bootstrap-servers", fleet.bootstrap, "--results-topic", fleet.topics.results,
            "--tokens-topic", fleet.topics.tokens, "--from-beginning", "--json", "--idle-timeout", "10"]
    job_flags = [flag for job_id in ids for flag in ("--job-id", job_id)]
    capsys.readouterr()
    assert tokenmill([*base, *job_flags, "--count", str(len(ids)), "--schema-registry", fleet.registry]) == 0
    tailed = {r["job_id"]: Result.model_validate(r) for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert tailed == {job_id: read[job_id] for job_id in ids}
    stream_flags = [flag for job_id in streamed for flag in ("--job-id", job_id)]
    assert tokenmill([*base, "--tokens", *stream_flags, "--count", str(len(streamed)),
                      "--schema-registry", fleet.registry]) == 0
    texts = {s["job_id"]: s["text"] for s in map(json.loads, capsys.readouterr().out.splitlines())}
    assert texts == {job_id: read[job_id].text for job_id in streamed}
    # Without the registry, tail says how to read them instead of printing bytes.
    assert tokenmill([*base, "--job-id", f"{tag}-c", "--idle-timeout", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "give --schema-registry to read it" in out.err


def test_backfill_sends_framed_jobs_and_reads_the_framed_results(fleet, tmp_path):
    rows = [{"id": f"r{i}", "q": f"what is {i}?"} for i in range(8)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    assert tokenmill(["backfill", "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                      "--prompt-template", "Q: {q}\nA:", "--key-column", "id", "--max-tokens", "2",
                      "--temperature", "0", "--bootstrap-servers", fleet.bootstrap, "--jobs-topic", fleet.topics.jobs,
                      "--results-topic", fleet.topics.results, "--schema-registry", fleet.registry,
                      "--timeout", "120", "--no-progress"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in written] == [r["id"] for r in rows]
    assert {r["status"] for r in written} == {"ok"} and all(r["text"] is not None for r in written)
    # The jobs went out framed; the Results it read were framed too (in the worker's format).
    jobs = _records(fleet, fleet.topics.jobs, {r["job_id"].encode() for r in written})
    results = _records(fleet, fleet.topics.results, {r["job_id"].encode() for r in written})
    for row in written:
        (job_rec,) = jobs[row["job_id"].encode()]
        assert Job.model_validate(fleet.json_of(fleet.topics.jobs, job_rec.value)).job_id == row["job_id"]
        assert fleet.result_of(results[row["job_id"].encode()][0].value).text == row["text"]


def test_evals_kafka_runner_sends_framed_jobs_and_reads_the_framed_results(fleet, tmp_path):
    from tokenmill.eval.kafka_runner import KafkaJobRunner
    from tokenmill.tools.backfill.kafka_backend import KafkaSettings

    settings = KafkaSettings(fleet.bootstrap, fleet.topics.jobs, fleet.topics.results, {}, fleet.model,
                             RegistrySettings(fleet.registry))
    runner = KafkaJobRunner(settings, tmp_path / "state.sqlite", {"run": "registry"}, timeout_s=120)
    try:
        jobs = [Job(job_id=f"{runner.id_prefix}-gen-{i:07d}", prompt_token_ids=[5 + i, 7, 9],
                    sampling=Sampling(max_tokens=2, temperature=0.0, logprobs=1)) for i in range(4)]
        got = runner(jobs)
    finally:
        runner.close()
    assert sorted(got) == [j.job_id for j in jobs]
    assert all(r.status == "ok" and len(r.token_ids) == 2 and len(r.logprobs) == 2 for r in got.values())
    sent = _records(fleet, fleet.topics.jobs, {j.job_id.encode() for j in jobs})
    assert all(fleet.json_of(fleet.topics.jobs, recs[0].value)["job_id"] == key.decode() for key, recs in sent.items())


def test_tokenmill_eval_through_the_fleet_with_the_registry(fleet, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = tokenmill(["eval", "--model", fleet.model_dir, "--tasks", "tokenmill_mc", "--limit", "2",
                      "--bootstrap-iters", "0", "--output", str(out), "--no-progress",
                      "--bootstrap-servers", fleet.bootstrap, "--jobs-topic", fleet.topics.jobs,
                      "--results-topic", fleet.topics.results, "--state", str(tmp_path / "state.sqlite"),
                      "--timeout", "180", "--schema-registry", fleet.registry])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "acc,none" in json.loads(out.read_text())["results"]["tokenmill_mc"]
    sent = re.search(r"(\d+) job\(s\) sent", err)
    assert sent and int(sent[1]) > 0, err
    # Its jobs went out framed with the Job's JSON Schema (eval ids: eval-<hex>-<kind>-<index>).
    records = asyncio.run(read_topic(fleet.bootstrap, fleet.topics.jobs, lambda recs: False, timeout=1.5))
    mine = [r for r in records if r.value[:1] == b"\x00" and b'"job_id":"eval-' in r.value]
    assert len(mine) >= int(sent[1])
    assert all(Job.model_validate(fleet.json_of(fleet.topics.jobs, r.value)).model == fleet.model for r in mine)
