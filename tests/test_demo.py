"""tokenmill demo end to end (with the tiny test model, to stay quick; `make demo` uses SmolLM2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tokenmill.storage.checkpoint import cache_root
from tokenmill.tools.demo import EXTRACT_JOB_ID, PERSON_SCHEMA, check_extraction, extraction_job, sample_jobs

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[1]


def test_sample_jobs_mix_chat_plain_and_streaming():
    jobs = sample_jobs(16, "m")
    from tokenmill.schemas import Job

    parsed = [Job.model_validate(j) for j in jobs]
    assert len({j.job_id for j in parsed}) == len(parsed) >= 5
    assert any(j.messages for j in parsed) and any(j.prompt for j in parsed)
    assert any(j.stream for j in parsed) and not all(j.stream for j in parsed)
    assert all(j.model == "m" and j.sampling.max_tokens == 16 for j in parsed)


def test_the_extraction_job_is_a_constrained_chat_job_and_its_check_refuses_bad_output():
    from tokenmill.schemas import Job

    job = Job.model_validate(extraction_job("m"))
    assert job.job_id == EXTRACT_JOB_ID and job.messages and job.model == "m" and not job.stream
    assert job.sampling.structured_outputs.json == PERSON_SCHEMA and job.sampling.temperature == 0.0
    good = {"status": "ok", "finish_reason": "stop", "text": '{"name":"Maria Lopez","age":34,"city":"Lisbon"}'}
    assert check_extraction(good) == ({"name": "Maria Lopez", "age": 34, "city": "Lisbon"}, "")
    for bad, why in (
        ({**good, "finish_reason": "length"}, "finish_reason 'length'"),
        ({**good, "text": '{"name":"Maria'}, "not JSON"),
        ({**good, "text": '{"name":"Maria","age":34}'}, "exactly name, age, city"),
        ({**good, "text": '{"name":"Maria","age":true,"city":"Lisbon"}'}, "age True"),
        ({**good, "text": '{"name":"Maria","age":34,"city":"1x"}'}, "city '1x'"),
        ({"status": "error", "error": {"code": "invalid_constraint"}}, "no ok Result"),
        (None, "no ok Result"),
    ):
        value, reason = check_extraction(bad)
        assert value is None and why in reason, (bad, reason)


def test_demo_streams_tokens_prints_results_and_cleans_up(tiny_llama_dir):
    demo_root = cache_root() / "demo"
    before = set(demo_root.iterdir()) if demo_root.exists() else set()
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "demo", "--model", str(tiny_llama_dir), "--max-tokens", "6",
         "--timeout", "300"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    jobs = sample_jobs(6, "x")
    for job in jobs:
        assert f"RESULT [ok] {job['job_id']} " in out, out[-4000:]
        if job["stream"]:
            assert f"[{job['job_id']}] +" in out  # tokens shown as they streamed
            assert f"[{job['job_id']}] stream finished:" in out
    assert "ttft" in out and "total" in out  # timings
    assert f"{len(jobs)}/{len(jobs)} jobs ok" in out
    # The structured-output job: constrained to its schema even on a random-weight model.
    assert f"RESULT [ok] {EXTRACT_JOB_ID} " in out and "1/1 extraction valid" in out, out[-4000:]
    extracted = next(line for line in out.splitlines() if line.startswith("demo: extracted "))
    value = json.loads(extracted[len("demo: extracted "):].rsplit(": parses", 1)[0])
    jsonschema.validate(value, PERSON_SCHEMA)
    assert "worker stopped (exit 0)" in out and "Kafka stopped" in out
    after = set(demo_root.iterdir()) if demo_root.exists() else set()
    assert after <= before, "the demo left its data folder behind"
