"""tokenmill backfill through Kafka and a real worker: S3 Parquet in and out, kill and resume, reruns."""

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.worker_helpers import end_offsets, make_topics, start_worker_process, stop_process, worker_command
from tokenmill.tools.backfill import BackfillConfig, JobSpec, run_backfill_sync

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[1]


def _results_in_state(state: Path) -> int:
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_kafka_backfill_s3_parquet_killed_resumed_and_rerun(kafka_bootstrap, tiny_llama_dir, s3_bucket, tmp_path):
    rows = [{"id": f"r{i:03d}", "question": f"what is item {i}?"} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=50)
    s3 = boto3.client("s3")
    s3.upload_file(str(tmp_path / "in.parquet"), s3_bucket, "in/questions.parquet")
    inp, out = f"s3://{s3_bucket}/in/questions.parquet", f"s3://{s3_bucket}/out/answers.parquet"
    topics = asyncio.run(make_topics(kafka_bootstrap, "backfill", partitions=2))
    state = tmp_path / "state.sqlite"
    flags = ["--prompt-template", "Q: {question}\nA:", "--key-column", "id", "--max-tokens", "8",
             "--temperature", "0", "--jobs-topic", topics.jobs, "--results-topic", topics.results]
    # Four jobs at a time, eight tokens each: the results come in over a second or more even on a fast
    # CPU, so the kill below lands mid-run (with 64 at a time and 4 tokens every result could be in
    # before the first poll saw 30).
    worker = start_worker_process(worker_command(kafka_bootstrap, topics, str(tiny_llama_dir), "--max-num-seqs", "4"),
                                  tmp_path / "worker.log")
    try:
        # First run, killed (SIGKILL, no clean-up at all) once some results are in.
        cmd = [sys.executable, "-m", "tokenmill.cli", "backfill", "--bootstrap-servers", kafka_bootstrap,
               "--input", inp, "--output", out, "--state", str(state), "--no-progress", *flags]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while _results_in_state(state) < 30 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        log = proc.communicate()[0].decode()
        assert proc.returncode == -signal.SIGKILL, log
        done_before = _results_in_state(state)
        assert 0 < done_before < 300, (done_before, log)

        spec = JobSpec(prompt_template="Q: {question}\nA:", sampling={"max_tokens": 8, "temperature": 0})
        cfg = BackfillConfig(input=inp, output=out, state=str(state), spec=spec, key_column="id",
                             bootstrap_servers=kafka_bootstrap, jobs_topic=topics.jobs,
                             results_topic=topics.results, timeout_s=240, progress=False)
        resumed = run_backfill_sync(cfg)
        # Results of jobs sent before the kill are picked up from the stored result-topic offsets;
        # only rows still without a result are sent again.
        assert resumed.submitted <= 300 - done_before
        assert (resumed.rows, resumed.ok, resumed.pending) == (300, 300, 0)

        s3.download_file(s3_bucket, "out/answers.parquet", str(tmp_path / "answers.parquet"))
        table = pq.read_table(tmp_path / "answers.parquet")
        assert table.num_rows == 300
        assert table.column("row").to_pylist() == list(range(300))
        assert table.column("key").to_pylist() == [r["id"] for r in rows]
        assert len(set(table.column("job_id").to_pylist())) == 300
        assert set(table.column("status").to_pylist()) == {"ok"}

        # Nothing changed: not one job is sent.
        before = asyncio.run(end_offsets(kafka_bootstrap, topics.jobs, 2))
        again = run_backfill_sync(cfg)
        assert again.submitted == 0 and again.ok == 300
        assert asyncio.run(end_offsets(kafka_bootstrap, topics.jobs, 2)) == before
    finally:
        assert stop_process(worker) == 0, (tmp_path / "worker.log").read_text()[-3000:]
