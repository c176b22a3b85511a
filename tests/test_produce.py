"""tokenmill produce against the real local broker (and, for the OpenAI batch file, a real worker)."""

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.worker_helpers import make_topics, start_worker_process, stop_process, worker_command
from tokenmill.cli import main
from tokenmill.schemas import decode_job, parse_input_line
from tokenmill.tools.kafka_topics import topic_partitions
from tokenmill.tools.produce import key_for, prefix_key, topic_for

pytestmark = pytest.mark.kafka


def _job_line(i, **extra):
    return json.dumps({"job_id": f"j{i}", "prompt": f"prompt {i}", "sampling": {"max_tokens": 2}, **extra})


def _openai_line(i):
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "test-llama-s0-v1", "max_tokens": 3, "temperature": 0,
                                "messages": [{"role": "user", "content": f"Say something about {i}"}]}})


async def _read_all(bootstrap, topic, expect, timeout=30.0):
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(consumer, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < expect and time.monotonic() < deadline:
            for tp, recs in (await consumer.getmany(timeout_ms=200)).items():
                out += [(tp.partition, r.key, r.value) for r in recs]
        return out
    finally:
        await consumer.stop()


def test_keys_and_topics():
    a = parse_input_line(json.dumps({"job_id": "a", "messages": [{"role": "system", "content": "S"},
                                                                  {"role": "user", "content": "x"}]}))
    b = parse_input_line(json.dumps({"job_id": "b", "messages": [{"role": "system", "content": "S"},
                                                                  {"role": "user", "content": "y"}]}))
    c = parse_input_line(json.dumps({"job_id": "c", "messages": [{"role": "system", "content": "T"},
                                                                  {"role": "user", "content": "x"}]}))
    d = parse_input_line(json.dumps({"job_id": "d", "tenant": "other", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "x"}]}))
    assert prefix_key(a) == prefix_key(b) != prefix_key(c)
    assert prefix_key(a) != prefix_key(d)  # tenants never share a cache, so never a key
    p1 = parse_input_line(json.dumps({"job_id": "p1", "prompt": "A" * 300 + "one"}))
    p2 = parse_input_line(json.dumps({"job_id": "p2", "prompt": "A" * 300 + "two"}))
    assert prefix_key(p1, 256) == prefix_key(p2, 256) and prefix_key(p1, 302) != prefix_key(p2, 302)
    assert key_for(a, "job_id") == b"a" and key_for(a, "none") is None
    m = parse_input_line(json.dumps({"job_id": "m", "prompt": "x", "model": "small"}))
    assert topic_for(m, "tokenmill.jobs.{model}") == "tokenmill.jobs.small"
    assert topic_for(m, "plain") == "plain"
    with pytest.raises(ValueError, match="model"):
        topic_for(a, "tokenmill.jobs.{model}")


def test_produce_reports_invalid_lines_and_sends_the_rest(kafka_bootstrap, new_topic, tmp_path, capsys):
    topic = new_topic(partitions=2)
    lines = [_job_line(0), _openai_line(1), "not json", _job_line(3, sampling={"max_tokens": 0}), "", _job_line(5)]
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topic, "--no-progress", str(path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "line 3:" in err and "line 4:" in err and "max_tokens" in err
    assert "sent 3 job(s)" in err and "2 invalid line(s)" in err
    records = asyncio.run(_read_all(kafka_bootstrap, topic, 3))
    assert len(records) == 3
    jobs = {decode_job(v).job_id: k for _, k, v in records}
    assert jobs == {"j0": b"j0", "req-1": b"req-1", "j5": b"j5"}  # keyed by job_id; custom_id kept


def test_produce_strict_sends_nothing_from_a_bad_file(kafka_bootstrap, new_topic, tmp_path, capsys):
    topic = new_topic()
    path = tmp_path / "jobs.jsonl"
    path.write_text(_job_line(0) + "\n" + '{"job_id": "x"}\n')
    code = main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topic, "--strict",
                 "--no-progress", str(path)])
    assert code == 2
    assert "line 2:" in capsys.readouterr().err
    assert asyncio.run(_read_all(kafka_bootstrap, topic, 1, timeout=2.0)) == []


def test_prefix_key_routes_shared_prefixes_to_one_partition(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=4)
    lines = []
    for i in range(24):
        system = f"You are assistant {i % 3}."
        lines.append(json.dumps({"job_id": f"k{i}", "messages": [{"role": "system", "content": system},
                                                                 {"role": "user", "content": f"q{i}"}]}))
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines))
    assert main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topic, "--key", "prefix",
                 "--no-progress", str(path)]) == 0
    records = asyncio.run(_read_all(kafka_bootstrap, topic, 24))
    partition_of_system = {}
    for partition, _key, value in records:
        system = json.loads(value)["messages"][0]["content"]
        partition_of_system.setdefault(system, set()).add(partition)
    assert len(partition_of_system) == 3
    assert all(len(parts) == 1 for parts in partition_of_system.values())


def test_produce_routes_by_model_and_respects_rate(kafka_bootstrap, new_topic, tmp_path, capsys):
    stem = new_topic()  # just a unique name to build the per-model topic names from
    from tokenmill.kafka.admin import create_topic_sync

    for model in ("large", "small"):
        create_topic_sync(kafka_bootstrap, f"{stem}.{model}", 1)
    lines = [_job_line(i, model="large" if i % 2 else "small") for i in range(10)]
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines))
    t0 = time.monotonic()
    code = main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", stem + ".{model}",
                 "--rate", "20", "--no-progress", str(path)])
    elapsed = time.monotonic() - t0
    assert code == 0
    assert elapsed >= 9 / 20 * 0.9, elapsed  # 10 jobs at 20/s: at least ~0.45 s
    large = asyncio.run(_read_all(kafka_bootstrap, f"{stem}.large", 5))
    small = asyncio.run(_read_all(kafka_bootstrap, f"{stem}.small", 5))
    assert sorted(json.loads(v)["job_id"] for _, _, v in large) == ["j1", "j3", "j5", "j7", "j9"]
    assert sorted(json.loads(v)["job_id"] for _, _, v in small) == ["j0", "j2", "j4", "j6", "j8"]


def test_openai_batch_file_of_100_lines_gets_100_results(kafka_bootstrap, tiny_llama_dir, tmp_path):
    """Done-when: produce of a 100-line OpenAI batch file -> 100 Results whose job_id is the custom_id."""
    topics = asyncio.run(make_topics(kafka_bootstrap, "produce-openai"))
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(_openai_line(i) for i in range(100)) + "\n")
    worker = start_worker_process(worker_command(kafka_bootstrap, topics, str(tiny_llama_dir)), tmp_path / "worker.log")
    try:
        assert main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topics.jobs,
                     "--no-progress", str(path)]) == 0
        records = asyncio.run(_read_all(kafka_bootstrap, topics.results, 100, timeout=180))
    finally:
        stop_process(worker)
    results = {}
    for _, key, value in records:
        r = json.loads(value)
        assert key == r["job_id"].encode()
        results.setdefault(r["job_id"], r)
    assert set(results) == {f"req-{i}" for i in range(100)}, (tmp_path / "worker.log").read_text()[-3000:]
    assert all(r["status"] == "ok" and r["usage"]["completion_tokens"] <= 3 for r in results.values())


def test_produce_from_stdin_and_strict_stops_at_the_first_bad_line(kafka_bootstrap, new_topic, monkeypatch, capsys):
    import io
    import types

    topic = new_topic()
    data = (_job_line(0) + "\n" + _job_line(1) + "\n" + "{broken\n" + _job_line(3) + "\n").encode()
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
    code = main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topic, "--strict",
                 "--no-progress", "-"])
    assert code == 2
    assert "line 3:" in capsys.readouterr().err
    records = asyncio.run(_read_all(kafka_bootstrap, topic, 3, timeout=3.0))
    assert sorted(json.loads(v)["job_id"] for _, _, v in records) == ["j0", "j1"]  # stopped before line 4


def _response_format_line(i, response_format, url="/v1/chat/completions"):
    body = {"model": "m", "max_tokens": 16, "response_format": response_format}
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"Describe person {i} as JSON"}]
    else:
        body["prompt"] = f"Person {i} as JSON:"
    return json.dumps({"custom_id": f"rf-{i}", "method": "POST", "url": url, "body": body})


def test_openai_lines_with_response_format_arrive_as_constrained_jobs(kafka_bootstrap, new_topic, tmp_path, capsys):
    """response_format json_schema / json_object -> sampling.structured_outputs on the jobs topic
    (the schema as written, key order kept); text -> no constraint; a malformed one is an invalid line."""
    topic = new_topic()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    lines = [
        _response_format_line(0, {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                          "schema": schema}}),
        _response_format_line(1, {"type": "json_object"}, url="/v1/completions"),
        _response_format_line(2, {"type": "text"}),
        _response_format_line(3, {"type": "json_schema", "json_schema": {"name": "person"}}),  # no schema
        _response_format_line(4, {"type": "yaml"}),
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topic, "--no-progress", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and "sent 3 job(s)" in err and "2 invalid line(s)" in err
    assert "line 4:" in err and "response_format.json_schema.schema" in err
    assert "line 5:" in err and "response_format.type" in err
    jobs = {}
    for _, _, value in asyncio.run(_read_all(kafka_bootstrap, topic, 3)):
        job = decode_job(value)
        jobs[job.job_id] = (job, json.loads(value))
    assert sorted(jobs) == ["rf-0", "rf-1", "rf-2"]
    job0, wire0 = jobs["rf-0"]
    assert wire0["sampling"]["structured_outputs"] == {"json": schema}
    assert list(wire0["sampling"]["structured_outputs"]["json"]["properties"]) == ["name", "age"]
    assert job0.sampling.structured_outputs.kind == "json" and job0.sampling.max_tokens == 16
    assert jobs["rf-1"][1]["sampling"]["structured_outputs"] == {"json_object": True}
    assert jobs["rf-1"][0].prompt == "Person 1 as JSON:"
    assert jobs["rf-2"][0].sampling.structured_outputs is None
    assert "structured_outputs" not in jobs["rf-2"][1]["sampling"]
