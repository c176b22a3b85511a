"""The client commands with a schema registry, against the real broker and a real registry
(Apicurio, the session fixture), no worker needed: `produce` frames Jobs per jobs topic (a
`{model}` template gives each topic its subject), `tail` reads plain, JSON Schema and Avro
Results side by side, and every command refuses bad registry flags, or a registry that does not
answer, with one line and an exit code."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.fixtures.registry import confluent_client
from tests.test_registry import ERROR_RESULT, SCORED_RESULT
from tests.test_schemas_export import CONTRACT_RESULT
from tests.worker_helpers import produce, read_topic
from tokenmill.cli import main as tokenmill
from tokenmill.cli.commands._registry_client import registry_error_exit
from tokenmill.kafka import answers
from tokenmill.kafka.admin import create_topic_sync
from tokenmill.kafka.registry import Framing, RegistryClient, RegistryError, RegistrySettings, value_subject
from tokenmill.schemas import Result
from tokenmill.schemas.export import render

pytestmark = pytest.mark.kafka


def _job_line(i: int, model: str) -> str:
    return json.dumps({"job_id": f"j{i}", "prompt": f"p{i}", "model": model, "sampling": {"max_tokens": 2}})


def test_produce_frames_each_model_topics_jobs_under_its_own_subject(kafka_bootstrap, new_topic, schema_registry,
                                                                      tmp_path):
    stem = new_topic()  # a unique name to build the per-model topic names from
    for model in ("large", "small"):
        create_topic_sync(kafka_bootstrap, f"{stem}.{model}", 1)
    (tmp_path / "jobs.jsonl").write_text("\n".join(_job_line(i, "large" if i % 2 else "small") for i in range(6)))
    assert tokenmill(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", stem + ".{model}",
                      "--schema-registry", schema_registry, "--no-progress", str(tmp_path / "jobs.jsonl")]) == 0
    confluent = confluent_client(schema_registry)
    client = RegistryClient(RegistrySettings(schema_registry))
    for model, ids in (("large", ["j1", "j3", "j5"]), ("small", ["j0", "j2", "j4"])):
        topic = f"{stem}.{model}"
        subject = value_subject(topic)
        registered = confluent.get_latest_version(subject)
        assert json.loads(registered.schema.schema_str) == json.loads(render("job"))
        # A jobs subject is created BACKWARD: the worker, reading Jobs, is upgraded first.
        assert client.request("GET", f"/config/{subject}")["compatibilityLevel"] == "BACKWARD"
        records = asyncio.run(read_topic(kafka_bootstrap, topic, lambda recs: len(recs) >= 3, timeout=30))
        deserializer = JSONDeserializer(None, schema_registry_client=confluent)
        jobs = [deserializer(r.value, SerializationContext(topic, MessageField.VALUE)) for r in records]
        assert [j["job_id"] for j in jobs] == ids and all(j["model"] == model for j in jobs)
        assert {int.from_bytes(r.value[1:5], "big") for r in records} == {registered.schema_id}


def test_tail_reads_plain_json_schema_and_avro_results_on_one_topic(kafka_bootstrap, new_topic, schema_registry,
                                                                   capsys):
    topic = new_topic()
    client = RegistryClient(RegistrySettings(schema_registry))
    # A JSON Schema framing, an Avro one (its schema under a subject of its own: a subject keeps one
    # format), and a plain Result, on one topic: the reader goes by each record's schema id.
    kw = {"tokens_topic": f"{topic}-tokens", "dlq_topic": f"{topic}-dlq"}
    by_json = asyncio.run(Framing.register(client, result_format="json", results_topic=topic, **kw))
    by_avro = asyncio.run(Framing.register(client, result_format="avro", results_topic=f"{topic}-avro", **kw))
    expected = [Result.model_validate(r) for r in (CONTRACT_RESULT, ERROR_RESULT, SCORED_RESULT)]
    expected = [r.model_copy(update={"job_id": f"{kind}-{r.job_id}"}) for kind, r in
                zip(("json", "avro", "plain"), expected, strict=True)]
    values = [answers.result_record(expected[0], topic, framing=by_json).value,
              answers.result_record(expected[1], topic, framing=by_avro).value,
              expected[2].to_json_bytes()]
    assert values[0][0] == 0 and values[1][0] == 0 and values[2][:1] == b"{"
    asyncio.run(produce(kafka_bootstrap, topic, values, keys=[r.job_id.encode() for r in expected]))
    base = ["tail", "--bootstrap-servers", kafka_bootstrap, "--results-topic", topic, "--from-beginning",
            "--json", "--idle-timeout", "3"]
    assert tokenmill([*base, "--schema-registry", schema_registry]) == 0
    tailed = [Result.model_validate(json.loads(line)) for line in capsys.readouterr().out.splitlines()]
    assert tailed == expected
    # Without the registry only the plain one can be read; the others are named and skipped.
    assert tokenmill(base) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["job_id"] for line in out.out.splitlines()] == [expected[2].job_id]
    assert out.err.count("give --schema-registry to read it") == 2


def test_bad_registry_flags_are_refused_before_anything_is_sent(kafka_bootstrap, tmp_path, capsys):
    (tmp_path / "jobs.jsonl").write_text(_job_line(0, "m") + "\n")
    assert tokenmill(["produce", str(tmp_path / "jobs.jsonl"), "--bootstrap-servers", kafka_bootstrap,
                      "--schema-registry-user", "u", "--schema-registry-ca", "ca.pem"]) == 2
    assert "--schema-registry-user, --schema-registry-ca need(s) --schema-registry" in capsys.readouterr().err
    assert tokenmill(["tail", "--bootstrap-servers", kafka_bootstrap, "--schema-registry", "ftp://reg",
                      "--schema-registry-user", "u"]) == 2
    err = capsys.readouterr().err
    assert "--schema-registry must be an http:// or https:// URL, got 'ftp://reg'" in err
    assert "--schema-registry-user and --schema-registry-password go together" in err
    assert tokenmill(["backfill", "--input", str(tmp_path / "jobs.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                      "--prompt-column", "prompt", "--engine", "local", "--model", "m",
                      "--schema-registry", "http://reg:8081"]) == 2
    assert "--schema-registry works with --engine kafka only" in capsys.readouterr().err
    assert tokenmill(["eval", "--model", "m", "--tasks", "tokenmill_mc", "--schema-registry", "http://reg:8081"]) == 2
    assert "--schema-registry only work(s) through Kafka: add --bootstrap-servers" in capsys.readouterr().err


def test_a_registry_that_does_not_answer_stops_produce_with_exit_1(kafka_bootstrap, new_topic, tmp_path, capsys):
    topic = new_topic()
    (tmp_path / "jobs.jsonl").write_text(_job_line(0, "m") + "\n")
    assert tokenmill(["produce", str(tmp_path / "jobs.jsonl"), "--bootstrap-servers", kafka_bootstrap,
                      "--jobs-topic", topic, "--no-progress",
                      "--schema-registry", f"http://127.0.0.1:1/{uuid.uuid4().hex}"]) == 1
    assert "tokenmill produce: schema registry http://127.0.0.1:1/" in capsys.readouterr().err
    assert asyncio.run(read_topic(kafka_bootstrap, topic, lambda recs: bool(recs), timeout=1.0)) == []


def test_a_registry_refusal_exits_like_a_brokers():
    assert registry_error_exit("p", RegistryError(401, "who are you")) == 76
    assert registry_error_exit("p", RegistryError(403, "not you")) == 77
    assert registry_error_exit("p", RegistryError(409, "incompatible")) == 1
    assert registry_error_exit("p", ValueError("not the registry's")) is None
