"""A worker started with --model s3://... (local S3 server) downloads the checkpoint and answers jobs."""

import asyncio
import json
import os
from pathlib import Path

import boto3
import pytest

from tests.fixtures.models import cache_with_built_kernels
from tests.worker_helpers import make_topics, start_worker_process, stop_process, worker_command
from tokenmill.cli import main

pytestmark = pytest.mark.kafka


def test_worker_serves_a_checkpoint_from_s3(kafka_bootstrap, tiny_llama_dir, s3_bucket, tmp_path, monkeypatch, capsys):
    client = boto3.client("s3")
    for f in Path(tiny_llama_dir).iterdir():
        if f.is_file():
            client.upload_file(str(f), s3_bucket, f"models/tiny-llama/{f.name}")
    cache = cache_with_built_kernels(tmp_path / "cache")
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache))  # inherited by the worker process
    topics = asyncio.run(make_topics(kafka_bootstrap, "s3-worker"))
    model = f"s3://{s3_bucket}/models/tiny-llama/"
    worker = start_worker_process(
        worker_command(kafka_bootstrap, topics, model, "--served-model-name", "tiny"), tmp_path / "worker.log"
    )
    try:
        jobs = tmp_path / "jobs.jsonl"
        jobs.write_text("".join(
            json.dumps({"job_id": f"s3-{i}", "model": "tiny", "prompt": f"hello {i}",
                        "sampling": {"max_tokens": 3, "temperature": 0}}) + "\n" for i in range(5)))
        assert main(["produce", "--bootstrap-servers", kafka_bootstrap, "--jobs-topic", topics.jobs,
                     "--no-progress", str(jobs)]) == 0
        capsys.readouterr()
        assert main(["tail", "--bootstrap-servers", kafka_bootstrap, "--results-topic", topics.results,
                     "--from-beginning", "--json", "--unique", "--count", "5", "--idle-timeout", "120"]) == 0
        results = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    finally:
        code = stop_process(worker)
    log = (tmp_path / "worker.log").read_text()[-3000:]
    assert code == 0, log
    assert sorted(r["job_id"] for r in results) == [f"s3-{i}" for i in range(5)], log
    assert all(r["status"] == "ok" and r["model"] == "tiny" for r in results), results
    # The checkpoint came from S3 into the local cache (not from the local folder).
    cached = [p for p in (cache / "s3").rglob("config.json")]
    assert len(cached) == 1 and cached[0].read_bytes() == (Path(tiny_llama_dir) / "config.json").read_bytes()
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
