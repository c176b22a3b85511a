"""tokenmill demo end to end (with the tiny test model, to stay quick; `make demo` uses SmolLM2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.demo import sample_jobs
from worker.storage.checkpoint import cache_root

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[1]


def test_sample_jobs_mix_chat_plain_and_streaming():
    jobs = sample_jobs(16, "m")
    from schemas import Job

    parsed = [Job.model_validate(j) for j in jobs]
    assert len({j.job_id for j in parsed}) == len(parsed) >= 5
    assert any(j.messages for j in parsed) and any(j.prompt for j in parsed)
    assert any(j.stream for j in parsed) and not all(j.stream for j in parsed)
    assert all(j.model == "m" and j.sampling.max_tokens == 16 for j in parsed)


def test_demo_streams_tokens_prints_results_and_cleans_up(tiny_llama_dir):
    demo_root = cache_root() / "demo"
    before = set(demo_root.iterdir()) if demo_root.exists() else set()
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo", "--model", str(tiny_llama_dir), "--max-tokens", "6",
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
    assert "worker stopped (exit 0)" in out and "Kafka stopped" in out
    after = set(demo_root.iterdir()) if demo_root.exists() else set()
    assert after <= before, "the demo left its data folder behind"
