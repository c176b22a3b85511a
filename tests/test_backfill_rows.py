"""Backfill rows and backends without a model or a broker: planned rows, jobs validated once,
and what each backend does with the validated Jobs."""

import asyncio
import json

import pytest

from tests.offline_helpers import ScriptedEngine
from tokenmill.offline import OfflineRunner
from tokenmill.schemas import Job
from tokenmill.tools.backfill import BackfillConfig, JobSpec
from tokenmill.tools.backfill.kafka_backend import KafkaBackend
from tokenmill.tools.backfill.local_backend import LocalBackend
from tokenmill.tools.backfill.rows import PlannedRow, RowPlanner, jobs_for
from tokenmill.tools.backfill.store import ResultStore

SPEC = JobSpec(prompt_template="Q: {text}", sampling={"max_tokens": 2}, metadata_columns=("id",))


def _planned(n, columns):
    return PlannedRow(n, f"bf-test-{n:09d}", str(n), False, columns)


def test_the_planner_streams_planned_rows_with_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": f"k{i}", "text": f"t{i}"}) + "\n" for i in range(5)))
    planner = RowPlanner(SPEC, path, "jsonl", "ds", "cfg", key_column="id")
    rows = [r for chunk in planner.chunks() for r in chunk]
    assert [r.number for r in rows] == list(range(5)) and [r.key for r in rows] == [f"k{i}" for i in range(5)]
    assert rows[0].columns == {"id": "k0", "text": "t0"} and not rows[0].chat and planner.rows_seen == 5
    assert len({r.job_id for r in rows}) == 5 and all(r.job_id.startswith("bf-") for r in rows)
    assert [r.key for chunk in RowPlanner(SPEC, path, "jsonl", "ds", "cfg").chunks() for r in chunk] == list("01234")
    with pytest.raises(ValueError, match="no key column 'nope'"):
        list(RowPlanner(SPEC, path, "jsonl", "ds", "cfg", key_column="nope").chunks())


def test_jobs_for_validates_each_row_once_and_answers_the_rest_with_invalid_job():
    rows = [
        _planned(0, {"id": "a", "text": "fine"}),
        _planned(1, {"id": "b"}),  # no text column
        _planned(2, {"id": "c", "text": ""}),  # an empty prompt: the contract refuses it
    ]
    spec = JobSpec(prompt_column="text", metadata_columns=("id",))
    jobs, errors = jobs_for(rows, spec, "m")
    assert [(row.number, type(job)) for row, job in jobs] == [(0, Job)]
    assert jobs[0][1].prompt == "fine" and jobs[0][1].metadata == {"row": 0, "id": "a"}
    assert [e["job_id"] for e in errors] == ["bf-test-000000001", "bf-test-000000002"]
    assert {e["error"]["code"] for e in errors} == {"invalid_job"}
    assert errors[0]["error"]["message"].startswith("row 1: ") and "text" in errors[0]["error"]["message"]
    assert errors[1]["error"]["message"].startswith("row 2: ") and "prompt" in errors[1]["error"]["message"]
    assert errors[0]["model"] == "m" and errors[0]["metadata"] == {"row": 1}
    assert jobs_for(rows[1:2], spec, "")[1][0]["model"] == "none"


def _validations(monkeypatch):
    calls = []
    original = Job.model_validate.__func__

    def counting(cls, *args, **kwargs):
        calls.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(Job, "model_validate", classmethod(counting))
    return calls


def test_the_local_backend_runs_the_validated_jobs_through_the_offline_runner(tmp_path, monkeypatch):
    rows = [_planned(i, {"id": f"k{i}", "text": f"t{i}"}) for i in range(5)]
    store = ResultStore(tmp_path / "state.sqlite")
    store.plan_rows(rows, retry_failed=False)
    cfg = BackfillConfig(input="-", output="-", spec=SPEC, engine="local", model_path="unused", max_in_flight=2)
    backend = LocalBackend(cfg)
    backend.store, backend.model_name = store, "scripted"
    engine = ScriptedEngine(max_num_seqs=4, steps=2)
    backend.runner = OfflineRunner(engine, worker="backfill", max_in_flight=cfg.max_in_flight)
    seen = []
    backend.on_results = seen.extend
    jobs = [job for _, job in jobs_for(rows, SPEC, "scripted")[0]]
    calls = _validations(monkeypatch)
    asyncio.run(backend.submit(jobs))
    asyncio.run(backend.wait_done(None))
    assert calls == [] and engine.peak == 2
    assert sorted(r["job_id"] for r in seen) == [r.job_id for r in rows]
    assert store.counts() == {"ok": 5, "error": 0, "expired": 0, "pending": 0}
    store.close()


class _Producer:
    def __init__(self):
        self.sent = []

    async def send(self, topic, value, key):
        self.sent.append((topic, value, key))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def test_the_kafka_backend_sends_each_validated_job_in_its_wire_form(monkeypatch):
    spec = JobSpec(prompt_column="text", model="served", sampling={"max_tokens": 2, "temperature": 0.0})
    cfg = BackfillConfig(input="-", output="-", spec=spec, bootstrap_servers="unused", jobs_topic="jobs.{model}")
    backend = KafkaBackend(cfg, "bf-test-")
    backend.producer = _Producer()
    jobs = [job for _, job in jobs_for([_planned(i, {"text": f"t{i}"}) for i in range(3)], spec, "served")[0]]
    calls = _validations(monkeypatch)
    asyncio.run(backend.submit(jobs))
    assert calls == []
    assert [(topic, key) for topic, _, key in backend.producer.sent] == [
        ("jobs.served", f"bf-test-{i:09d}".encode()) for i in range(3)
    ]
    first = json.loads(backend.producer.sent[0][1])
    assert first == spec.job_dict("bf-test-000000000", 0, {"text": "t0"})  # the fields given, defaults implicit


# -- structured output: the constraint options, the fingerprint, the parsed column -------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_the_constraint_options_build_structured_outputs_and_refuse_bad_input(tmp_path):
    from tokenmill.tools.backfill.constraints import constraint_from_options, with_constraint

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert constraint_from_options(schema) == {"json": PERSON}
    assert constraint_from_options(schema, whitespace="flexible") == {"json": PERSON, "whitespace": "flexible"}
    assert constraint_from_options(choices=["positive", "negative"]) == {"choice": ["positive", "negative"]}
    assert constraint_from_options() is None
    (tmp_path / "bad.json").write_text('{"type": "object",')
    (tmp_path / "list.json").write_text("[1, 2]")
    for kwargs, message in (
        ({"json_schema": tmp_path / "missing.json"}, "no such file: .*missing.json"),
        ({"json_schema": tmp_path / "bad.json"}, "bad.json is not JSON"),
        ({"json_schema": tmp_path / "list.json"}, "holds a JSON array, not a JSON Schema object"),
        ({"json_schema": schema, "choices": ["a"]}, "exclusive"),
        ({"choices": ["a", "b"], "whitespace": "compact"}, "--whitespace goes with --json-schema"),
        ({"choices": ["a", "b", "a"]}, "more than once: 'a'"),
        ({"choices": ["a", ""]}, "non-empty label"),
    ):
        with pytest.raises(ValueError, match=message):
            constraint_from_options(**kwargs)
    assert with_constraint({"max_tokens": 4}, {"choice": ["a"]}) == {"max_tokens": 4, "structured_outputs": {"choice": ["a"]}}
    with pytest.raises(ValueError, match="give the constraint once"):
        with_constraint({"structured_outputs": {"regex": "a+"}}, {"choice": ["a"]})


def test_the_constraint_is_part_of_the_job_identity():
    def fp(constraint):
        sampling = {"max_tokens": 8} if constraint is None else {"max_tokens": 8, "structured_outputs": constraint}
        return JobSpec(prompt_column="text", sampling=sampling).fingerprint()

    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    distinct = [None, {"json": PERSON}, {"json": reordered}, {"json": PERSON, "whitespace": "flexible"},
                {"json_object": True}, {"choice": ["a", "b"]}, {"choice": ["b", "a"]}, {"regex": "[ab]"}]
    assert len({fp(c) for c in distinct}) == len(distinct)  # key order is the order the output writes
    # The same constraint however written: a schema object and its text, an explicit default.
    assert fp({"json": PERSON}) == fp({"json": json.dumps(PERSON, indent=2)}) == fp({"json": PERSON, "whitespace": "compact"})
    # An unconstrained spec fingerprints as it did before the field existed.
    from tokenmill.tools.backfill.jobs import _fingerprinted_sampling

    assert "structured_outputs" not in _fingerprinted_sampling({"max_tokens": 8})
    with pytest.raises(ValueError, match="structured_outputs"):
        JobSpec(prompt_column="text", sampling={"structured_outputs": {"json": PERSON, "choice": ["a"]}})
    job = JobSpec(prompt_column="text", sampling={"structured_outputs": {"json": PERSON}}).job("j", 0, {"text": "x"})
    assert job.sampling.structured_outputs.json == PERSON


def _result(job_id, text, finish_reason="stop", status="ok"):
    res = {"job_id": job_id, "status": status, "text": text, "finish_reason": finish_reason,
           "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    if status != "ok":
        res["error"] = {"code": "invalid_constraint", "message": "bad schema"}
    return res


def test_the_parsed_column_holds_the_value_or_null_in_jsonl_and_parquet(tmp_path):
    import pyarrow.parquet as pq

    from tokenmill.tools.backfill.constraints import OutputParser
    from tokenmill.tools.backfill.output import write_output

    store = ResultStore(tmp_path / "state.sqlite")
    rows = [_planned(i, {}) for i in range(4)]
    store.plan_rows(rows, retry_failed=False)
    store.add_results([
        _result(rows[0].job_id, '{"name":"Ada","age":36}'),
        _result(rows[1].job_id, '{"name":"Bo', "length"),  # cut by max_tokens: null, raw text kept
        _result(rows[2].job_id, None, None, status="error"),
        _result(rows[3].job_id, '{"name":"Cy","age":7}', "length"),  # complete text, but cut: still null
    ])
    parser = OutputParser.for_sampling({"structured_outputs": {"json": PERSON}})
    assert write_output(store, tmp_path / "out.jsonl", "jsonl", parser) == 4
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["parsed"] for line in lines] == [{"name": "Ada", "age": 36}, None, None, None]
    assert lines[1]["text"] == '{"name":"Bo' and lines[2]["error_code"] == "invalid_constraint"
    assert (parser.parsed, parser.unparsed) == (1, 2)  # the error row is neither
    write_output(store, tmp_path / "out.parquet", "parquet", OutputParser.for_sampling({"structured_outputs": {"json": PERSON}}))
    table = pq.read_table(tmp_path / "out.parquet")
    assert str(table.schema.field("parsed").type) == "string"
    assert table.column("parsed").to_pylist() == ['{"name":"Ada","age":36}', None, None, None]

    labels = OutputParser.for_sampling({"structured_outputs": {"choice": ["yes", "no"]}})
    assert [labels.value(_result("j", t, f)) for t, f in (("yes", "stop"), ("maybe", "stop"), ("ye", "length"))] == ["yes", None, None]
    assert OutputParser.for_sampling({"structured_outputs": {"regex": "[0-9]+"}}) is None
    assert OutputParser.for_sampling({"max_tokens": 3}) is None
    write_output(store, tmp_path / "plain.parquet", "parquet")
    assert "parsed" not in pq.read_table(tmp_path / "plain.parquet").schema.names  # no constraint, no column
    store.close()


def test_the_kafka_backend_sends_the_constraint_in_each_job_as_given():
    reordered = {**PERSON, "properties": {"age": PERSON["properties"]["age"], "name": PERSON["properties"]["name"]}}
    spec = JobSpec(prompt_column="text", sampling={"max_tokens": 32, "structured_outputs": {"json": reordered}})
    backend = KafkaBackend(BackfillConfig(input="-", output="-", spec=spec, bootstrap_servers="unused"), "bf-test-")
    backend.producer = _Producer()
    asyncio.run(backend.submit([job for _, job in jobs_for([_planned(0, {"text": "t"})], spec, "m")[0]]))
    wire = json.loads(backend.producer.sent[0][1])
    assert wire["sampling"]["structured_outputs"] == {"json": reordered}
    assert list(wire["sampling"]["structured_outputs"]["json"]["properties"]) == ["age", "name"]
