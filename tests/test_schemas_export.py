"""The JSON Schema files: in sync with the models, and they accept and reject what the contract says."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from tokenmill.cli import main as cli_main
from tokenmill.schemas import decode_job
from tokenmill.schemas.export import JSON_DIR, SCHEMAS, main, render, schema_path, stale_files, write_all

# The example messages of the contract, verbatim.
CONTRACT_JOB = {
    "job_id": "row-000017",
    "prompt": "Translate to French: good morning",
    "sampling": {"max_tokens": 64, "temperature": 0.0},
    "stream": True,
    "metadata": {"dataset": "eval-2026-11"},
}
CONTRACT_EVENT = {
    "job_id": "row-000017",
    "attempt": "w3-7f2c",
    "index": 0,
    "token_ids": [1012, 318],
    "text": "Bon",
    "finished": False,
}
CONTRACT_RESULT = {
    "job_id": "row-000017",
    "status": "ok",
    "text": "Bonjour",
    "token_ids": [1012, 318, 29889],
    "finish_reason": "stop",
    "model": "tiny-llama",
    "worker": "w3",
    "attempt": "w3-7f2c",
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "cached_prompt_tokens": 0},
    "timing": {"queue_ms": 12.0, "ttft_ms": 40.1, "decode_ms": 22.9, "total_ms": 75.0},
    "source": {"topic": "tokenmill.jobs", "partition": 2, "offset": 1881},
    "metadata": {"dataset": "eval-2026-11"},
}


def constrained(structured_outputs: dict) -> dict:
    return {**CONTRACT_JOB, "sampling": {"structured_outputs": structured_outputs}}


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(schema_path(name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_files_match_the_models():
    assert stale_files() == [], "schema files drifted from the models: run python -m schemas.export"
    assert main(["--check"]) == 0


def test_check_notices_drift(tmp_path, capsys):
    write_all(tmp_path)
    assert stale_files(tmp_path) == []
    path = schema_path("job", tmp_path)
    path.write_text(path.read_text().replace('"maximum": 20', '"maximum": 21'))
    assert stale_files(tmp_path) == [path]
    assert main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().err
    (tmp_path / "result.schema.json").unlink()
    assert len(stale_files(tmp_path)) == 2


def test_export_module_writes_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.schemas.export", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dead_letter.schema.json",
        "job.schema.json",
        "result.schema.json",
        "token_event.schema.json",
    ]
    assert len(proc.stdout.splitlines()) == 4


@pytest.mark.parametrize(
    "name,example", [("job", CONTRACT_JOB), ("token-event", CONTRACT_EVENT), ("result", CONTRACT_RESULT)]
)
def test_contract_examples_are_valid(name, example):
    validator(name).validate(example)


@pytest.mark.parametrize(
    "name,job",
    [
        ("unknown field", {**CONTRACT_JOB, "colour": "red"}),
        ("unknown sampling field", {**CONTRACT_JOB, "sampling": {"max_new_tokens": 3}}),
        ("no prompt", {k: v for k, v in CONTRACT_JOB.items() if k != "prompt"}),
        ("only a null prompt", {**CONTRACT_JOB, "prompt": None}),
        ("two prompts", {**CONTRACT_JOB, "messages": [{"role": "user", "content": "hi"}]}),
        ("max_tokens 0", {**CONTRACT_JOB, "sampling": {"max_tokens": 0}}),
        ("empty prompt", {**CONTRACT_JOB, "prompt": ""}),
        ("max_tokens as a string", {**CONTRACT_JOB, "sampling": {"max_tokens": "10"}}),
        ("17 stop strings", {**CONTRACT_JOB, "sampling": {"stop": ["x"] * 17}}),
        ("logprobs 21", {**CONTRACT_JOB, "sampling": {"logprobs": 21}}),
        ("job_id too long", {**CONTRACT_JOB, "job_id": "x" * 257}),
        ("bad role", {"job_id": "a", "messages": [{"role": "robot", "content": "hi"}]}),
        ("no constraint kind", constrained({})),
        ("two constraint kinds", constrained({"regex": "a", "choice": ["a"]})),
        ("json_object false alone", constrained({"json_object": False})),
        ("null kind only", constrained({"regex": None})),
        ("empty choice", constrained({"choice": []})),
        ("json a number", constrained({"json": 5})),
        ("unknown constraint key", constrained({"regex": "a", "flags": "i"})),
        ("bad whitespace", constrained({"regex": "a", "whitespace": "x"})),
    ],
)
def test_job_schema_rejects(name, job):
    assert list(validator("job").iter_errors(job)), name
    # The models reject the same jobs.
    with pytest.raises(ValueError):
        decode_job(json.dumps(job).encode())


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": {"type": "object"}},
        {"json": '{"type": "object"}', "whitespace": "flexible"},
        {"json_object": True},
        {"regex": "[0-9]+", "json_object": False, "json": None},
        {"choice": ["a", "b"]},
        {"grammar": 'start: "a"'},
    ],
)
def test_job_schema_accepts_each_constraint_kind(constraint):
    job = constrained(constraint)
    validator("job").validate(job)
    decode_job(json.dumps(job).encode())  # and so do the models


def test_job_schema_accepts_each_prompt_form():
    v = validator("job")
    v.validate({"job_id": "a", "messages": [{"role": "user", "content": "hi"}], "prompt": None})
    v.validate({"job_id": "a", "prompt_token_ids": [1, 2]})


@pytest.mark.parametrize(
    "result",
    [
        {**CONTRACT_RESULT, "finish_reason": None},
        {**CONTRACT_RESULT, "status": "error"},
        {**CONTRACT_RESULT, "error": {"code": "internal", "message": "x"}},
        {
            **CONTRACT_RESULT,
            "status": "expired",
            "finish_reason": None,
            "error": {"code": "internal", "message": "x"},
        },
        {
            **CONTRACT_RESULT,
            "status": "error",
            "finish_reason": None,
            "error": {"code": "oops", "message": "x"},
        },
    ],
)
def test_result_schema_rejects_disagreeing_status(result):
    assert list(validator("result").iter_errors(result))


def test_result_schema_accepts_error_and_expired():
    v = validator("result")
    base = {k: v for k, v in CONTRACT_RESULT.items() if k not in ("text", "token_ids", "finish_reason")}
    v.validate({**base, "status": "error", "error": {"code": "model_mismatch", "message": "wants m2"}})
    v.validate({**base, "status": "error", "error": {"code": "invalid_constraint", "message": "bad regex"}})
    v.validate({**base, "status": "expired"})


def test_the_dead_letter_schema_takes_what_the_headers_say():
    info = {"code": "invalid_job", "message": "not JSON", "source": {"topic": "jobs", "partition": 2, "offset": 7},
            "worker": "w1"}
    validator("dead-letter").validate(info)
    assert list(validator("dead-letter").iter_errors({**info, "code": "oops"}))


@pytest.mark.parametrize("record", ["job", "token-event", "result", "dead-letter"])
def test_cli_prints_one_schema(record, capsys):
    assert cli_main(["schema", record]) == 0
    assert capsys.readouterr().out == render(record)


def test_cli_prints_all(capsys):
    assert cli_main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == list(SCHEMAS)
    for name in SCHEMAS:
        assert printed[name] == json.loads(schema_path(name).read_text(encoding="utf-8"))


def test_schema_files_ship_with_the_package():
    assert JSON_DIR.name == "json" and (JSON_DIR / "job.schema.json").exists()


def test_jobs_the_models_accept_pass_the_schema():
    from hypothesis import given, settings

    from tests.test_schemas_decode import valid_jobs

    job_validator = validator("job")

    @settings(max_examples=100, deadline=None, database=None)
    @given(valid_jobs)
    def check(obj):
        job_validator.validate(obj)  # what the producer wrote
        job_validator.validate(json.loads(decode_job(json.dumps(obj).encode()).to_json_bytes()))

    check()


def scoring(**sampling) -> dict:
    return {**CONTRACT_JOB, "sampling": sampling}


@pytest.mark.parametrize(
    "name,job",
    [
        ("max_tokens 0 without prompt_logprobs", scoring(max_tokens=0, logprobs=1)),
        ("max_tokens 0 with a null prompt_logprobs", scoring(max_tokens=0, prompt_logprobs=None)),
        ("max_tokens 0 with a constraint", scoring(max_tokens=0, prompt_logprobs=0, structured_outputs={"regex": "a"})),
        ("score_from without prompt_logprobs", scoring(score_from=5)),
        ("score_from 0", scoring(prompt_logprobs=0, score_from=0)),
        ("prompt_logprobs 21", scoring(prompt_logprobs=21)),
        ("n 0", scoring(n=0)),
        ("n 65", scoring(n=65)),
    ],
)
def test_job_schema_rejects_bad_scoring_fields(name, job):
    assert list(validator("job").iter_errors(job)), name
    with pytest.raises(ValueError):  # the models reject the same jobs
        decode_job(json.dumps(job).encode())


@pytest.mark.parametrize(
    "sampling",
    [{"max_tokens": 0, "prompt_logprobs": 0}, {"prompt_logprobs": 20, "score_from": 300, "max_tokens": 1},
     {"n": 64, "seed": 3}, {"score_from": 1}],
)
def test_job_schema_accepts_scoring_fields(sampling):
    job = scoring(**sampling)
    validator("job").validate(job)
    decode_job(json.dumps(job).encode())


def test_result_and_event_schemas_take_the_scoring_fields():
    top = [{"token_id": 2, "token": "b", "logprob": -0.1}]
    scored = {
        **CONTRACT_RESULT,
        "prompt_logprobs": [{"token_id": 1, "token": "a", "logprob": None, "rank": 7, "top_logprobs": top}],
        "is_greedy": False,
        "choices": [
            {"index": i, "text": "x", "token_ids": [3], "finish_reason": "stop", "completion_tokens": 1}
            for i in range(2)
        ],
    }
    v = validator("result")
    v.validate(scored)
    bad_rank = {**scored, "prompt_logprobs": [{**scored["prompt_logprobs"][0], "rank": 0}]}
    assert list(v.iter_errors(bad_rank))
    assert list(v.iter_errors({k: x for k, x in scored.items() if k != "is_greedy"}))  # is_greedy required
    expired = {**scored, "status": "expired", "finish_reason": None}
    assert list(v.iter_errors(expired))  # scoring parts only with status ok
    v.validate({k: x for k, x in expired.items() if k not in ("prompt_logprobs", "is_greedy", "choices")})
    validator("token-event").validate({**CONTRACT_EVENT, "choice": 1})
    assert list(validator("token-event").iter_errors({**CONTRACT_EVENT, "choice": -1}))
