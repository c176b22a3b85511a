"""Schema Registry framing against a real Confluent-compatible registry (Apicurio, started by the
session fixture): every record tokenmill writes round-trips through confluent-kafka's own
deserializers, and a framed Job is read, or dead-lettered with its reason."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.fixtures.registry import confluent_client
from tests.test_schemas_export import CONTRACT_EVENT, CONTRACT_JOB, CONTRACT_RESULT
from tokenmill.kafka import answers
from tokenmill.kafka.registry import (
    DEAD_LETTER_HEADER,
    Framing,
    JobReader,
    RegistryClient,
    RegistrySettings,
    ResultReader,
    value_subject,
)
from tokenmill.schemas import Result
from tokenmill.schemas.errors import JobDecodeError
from tokenmill.schemas.export import render
from tokenmill.schemas.wire import frame

ERROR_RESULT = {**{k: v for k, v in CONTRACT_RESULT.items() if k not in ("text", "token_ids", "finish_reason")},
                "status": "error", "error": {"code": "prompt_too_long", "message": "9000 tokens"}}
SCORED_RESULT = {**CONTRACT_RESULT, "is_greedy": True, "prompt_logprob_sum": -1.5,
                 "prompt_logprobs": [{"token_id": 1, "token": "a", "logprob": -1.5, "rank": 1,
                                      "top_logprobs": [{"token_id": 1, "token": "a", "logprob": -1.5}]}],
                 "logprobs": [{"token_id": 2, "token": "b", "logprob": None, "top_logprobs": []}]}


def _topics() -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {"results_topic": f"results-{tag}", "tokens_topic": f"tokens-{tag}", "dlq_topic": f"dlq-{tag}"}


def _framing(url: str, result_format: str = "json", **topics: str) -> Framing:
    client = RegistryClient(RegistrySettings(url))
    return asyncio.run(Framing.register(client, result_format=result_format, **topics))


def _json_deserialized(url: str, topic: str, value: bytes) -> dict:
    deserializer = JSONDeserializer(None, schema_registry_client=confluent_client(url))
    return deserializer(value, SerializationContext(topic, MessageField.VALUE))


@pytest.mark.parametrize("result", [CONTRACT_RESULT, ERROR_RESULT, SCORED_RESULT])
def test_results_round_trip_through_confluents_json_schema_deserializer(schema_registry, result):
    topics = _topics()
    framing = _framing(schema_registry, **topics)
    rec = answers.result_record(Result.model_validate(result), topics["results_topic"], 1 << 20, framing)
    assert rec.value[0] == 0  # the magic byte
    read = _json_deserialized(schema_registry, topics["results_topic"], rec.value)
    assert Result.model_validate(read) == Result.model_validate(result)


@pytest.mark.parametrize("result", [CONTRACT_RESULT, ERROR_RESULT, SCORED_RESULT])
def test_avro_results_round_trip_through_confluents_avro_deserializer(schema_registry, result):
    topics = _topics()
    framing = _framing(schema_registry, "avro", **topics)
    rec = answers.result_record(Result.model_validate(result), topics["results_topic"], 1 << 20, framing)
    deserializer = AvroDeserializer(confluent_client(schema_registry))
    record = deserializer(rec.value, SerializationContext(topics["results_topic"], MessageField.VALUE))
    assert record["job_id"] == result["job_id"] and record["usage"]["prompt_tokens"] == 9
    assert json.loads(record["metadata"]) == result["metadata"]  # free-form metadata travels as JSON text
    assert Result.model_validate(framing.avro.from_avro(record)) == Result.model_validate(result)
    # tokenmill's own reader (tail, backfill) reads it back too, with the writer's schema from the registry
    reader = ResultReader(RegistryClient(RegistrySettings(schema_registry)))
    assert Result.model_validate(asyncio.run(reader.decode(rec.value))) == Result.model_validate(result)


def test_token_events_and_dead_letter_metadata_round_trip(schema_registry):
    topics = _topics()
    framing = _framing(schema_registry, **topics)
    event = framing.token_event(json.dumps(CONTRACT_EVENT).encode())
    assert _json_deserialized(schema_registry, topics["tokens_topic"], event) == CONTRACT_EVENT
    rec = answers.dead_letter(b"k", b"\x00\x00\x00\x00\x07{}", "invalid_job", "schema id 7 is not known",
                              dlq_topic=topics["dlq_topic"], source_topic="jobs", partition=3, offset=41,
                              dlq_partition=None, framing=framing, worker="w1")
    assert rec.value == b"\x00\x00\x00\x00\x07{}"  # the input bytes, unchanged
    header = dict(rec.headers)[DEAD_LETTER_HEADER]
    info = _json_deserialized(schema_registry, topics["dlq_topic"], header)
    assert info == {"code": "invalid_job", "message": "schema id 7 is not known", "worker": "w1",
                    "source": {"topic": "jobs", "partition": 3, "offset": 41}}
    assert dict(rec.headers)["tokenmill.error.code"] == b"invalid_job"  # the plain headers stay
    # A value cut to fit the dead-letter topic: the framed record names its full length, as the plain header does.
    big = b"{" + b"x" * 5000
    cut = answers.dead_letter(b"k", big, "invalid_job", "not JSON", dlq_topic=topics["dlq_topic"], source_topic="jobs",
                              partition=0, offset=1, dlq_partition=None, limit=2000, framing=framing, worker="w1")
    assert cut.cut is not None and len(cut.value) < 2000 and big.startswith(cut.value)
    info = _json_deserialized(schema_registry, topics["dlq_topic"], dict(cut.headers)[DEAD_LETTER_HEADER])
    assert info["value_original_bytes"] == len(big) == int(dict(cut.headers)["tokenmill.value.original_bytes"])


def test_output_subjects_are_created_forward_compatible_and_registering_again_is_idempotent(schema_registry):
    topics = _topics()
    first, again = _framing(schema_registry, **topics), _framing(schema_registry, **topics)
    assert (first.result_id, first.token_event_id) == (again.result_id, again.token_event_id)
    client = RegistryClient(RegistrySettings(schema_registry))
    subject = value_subject(topics["results_topic"])
    assert client.request("GET", f"/config/{subject}")["compatibilityLevel"] == "FORWARD"
    # A Result schema without a field its readers know is refused (FORWARD, like schemas/compat.py).
    narrowed = json.loads(render("result"))
    narrowed["properties"].pop("usage")
    narrowed["required"] = [*narrowed["required"], "usage_v2"]
    with pytest.raises(Exception, match="409|incompatible"):
        client.ensure_subject_now(subject, json.dumps(narrowed), "JSON", None)


def _jobs_subject_schema_id(url: str, jobs_topic: str) -> tuple[RegistryClient, int]:
    client = RegistryClient(RegistrySettings(url))
    return client, client.ensure_subject_now(value_subject(jobs_topic), render("job"), "JSON", None)


def test_a_job_framed_by_confluents_serializer_is_read_and_unknown_or_foreign_schema_ids_are_refused(schema_registry):
    jobs_topic = f"jobs-{uuid.uuid4().hex[:8]}"
    client, job_id = _jobs_subject_schema_id(schema_registry, jobs_topic)
    serializer = JSONSerializer(render("job"), confluent_client(schema_registry),
                                conf={"auto.register.schemas": False, "use.latest.version": True})
    framed = serializer(CONTRACT_JOB, SerializationContext(jobs_topic, MessageField.VALUE))
    reader = JobReader(client, jobs_topic)
    other_topic = _topics()
    foreign = _framing(schema_registry, **other_topic).token_event_id  # a schema of another subject
    unknown = 1_000_000 + job_id
    values = [framed, frame(unknown, b"{}"), frame(foreign, b"{}"), json.dumps(CONTRACT_JOB).encode(), b"\x00\x01"]
    assert reader.needs_lookup(framed) and asyncio.run(reader.resolve(values))
    assert json.loads(reader.payload(framed)) == CONTRACT_JOB
    assert reader.payload(values[3]) == values[3]  # plain JSON as before
    with pytest.raises(JobDecodeError, match=f"schema id {unknown} is not known to the schema registry"):
        reader.payload(values[1])
    with pytest.raises(JobDecodeError, match=f"not a schema of subject {value_subject(jobs_topic)}"):
        reader.payload(values[2])
    with pytest.raises(JobDecodeError, match="magic byte 0 and a 4-byte schema id"):
        reader.payload(values[4])
    with pytest.raises(JobDecodeError, match="no --schema-registry"):
        JobReader(None, jobs_topic).payload(framed)


def test_the_reader_waits_while_the_registry_does_not_answer():
    reader = JobReader(RegistryClient(RegistrySettings("http://127.0.0.1:1", timeout_s=1.0)), "jobs")
    assert asyncio.run(reader.resolve([frame(5, b"{}")])) is False  # read again later, not dead-lettered


def test_registry_settings_say_what_is_wrong_and_hide_the_password():
    assert RegistrySettings("ftp://x", result_format="xml", username="u").problems() == [
        "--schema-registry must be an http:// or https:// URL, got 'ftp://x'",
        "--result-format must be one of json, avro",
        "--schema-registry-user and --schema-registry-password go together"]
    described = RegistrySettings("https://u:secret@reg:8081/apis/ccompat/v7").describe()
    assert described == {"url": "https://reg:8081/apis/ccompat/v7", "auth": True, "tls": True, "result_format": "json"}
