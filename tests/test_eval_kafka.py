"""`tokenmill eval` through Kafka and real workers: the local metrics with one worker, resuming
from the state file (a timeout, Results that came while no run listened, lost Results), a state
of another evaluation refused, and two workers with one killed halfway (no request lost)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import threading
import time
import urllib.request

import pytest

from tests.test_eval_cli import BOOTSTRAP, LIMIT, TASKS, in_process_metrics, metrics
from tests.worker_helpers import (
    end_offsets,
    make_topics,
    start_worker_process,
    stop_process,
    worker_command,
    worker_metrics,
)
from tokenmill.cli import main as tokenmill
from tokenmill.kafka.local_broker import free_port

pytestmark = pytest.mark.kafka

JOB_PARTITIONS = 2
SENT = re.compile(r"(\d+) job\(s\) sent, (\d+) answered from the state")


def _wait_serving(proc, port: int, log, partitions: int, timeout: float = 120) -> None:
    """Until the worker answers /readyz and owns ``partitions`` partitions of the jobs topic."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                ready = r.status == 200
            if ready and worker_metrics(port).get("tokenmill_partitions_assigned") == partitions:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"worker not serving {partitions} partition(s) within {timeout}s: {log.read_text()[-3000:]}")


class Fleet:
    def __init__(self, bootstrap, topics, model_dir, tmp):
        self.bootstrap, self.topics, self.model_dir, self.tmp = bootstrap, topics, model_dir, tmp
        self.procs: dict[str, tuple] = {}

    def start(self, name: str):
        port = free_port()
        log = self.tmp / f"worker-{name}.log"
        cmd = worker_command(self.bootstrap, self.topics, str(self.model_dir), "--metrics-port", str(port))
        self.procs[name] = (start_worker_process(cmd, log), port, log)
        return self.procs[name]

    def jobs_sent(self) -> int:
        return sum(asyncio.run(end_offsets(self.bootstrap, self.topics.jobs, JOB_PARTITIONS)).values())

    def results_published(self) -> int:
        return sum(asyncio.run(end_offsets(self.bootstrap, self.topics.results, 1)).values())


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-fleet")
    topics = asyncio.run(make_topics(kafka_bootstrap, "eval", partitions=JOB_PARTITIONS))
    f = Fleet(kafka_bootstrap, topics, tiny_llama_dir, tmp)
    proc, port, log = f.start("a")
    try:
        _wait_serving(proc, port, log, JOB_PARTITIONS)
        yield f
    finally:
        for proc, _, log in f.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            code = stop_process(proc)
            assert code in (0, -signal.SIGKILL), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def local_metrics(tiny_llama_dir):
    return in_process_metrics(tiny_llama_dir)


def _eval(fleet, tmp, capsys, state, *extra, tasks=TASKS, limit=LIMIT, timeout=180):
    out = tmp / f"results-{time.monotonic_ns()}.json"
    argv = ["eval", "--model", str(fleet.model_dir), "--tasks", tasks, "--limit", str(limit),
            "--bootstrap-iters", str(BOOTSTRAP), "--output", str(out), "--no-progress",
            "--bootstrap-servers", fleet.bootstrap, "--jobs-topic", fleet.topics.jobs,
            "--results-topic", fleet.topics.results, "--timeout", str(timeout), *extra]
    if state is not None:
        argv += ["--state", str(state)]
    code = tokenmill(argv)
    err = capsys.readouterr().err
    got = metrics(json.loads(out.read_text())) if code == 0 else None
    sent = SENT.search(err)
    return code, err, got, (int(sent[1]), int(sent[2])) if sent else None


def _state_counts(state) -> tuple[int, int]:
    """(this run's jobs, of which with a Result) in a state file; (0, 0) before it has tables."""
    if not state.exists():
        return 0, 0
    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1)
    try:
        rows = db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
        done = db.execute("SELECT COUNT(*) FROM rows JOIN results USING (job_id)").fetchone()[0]
    except sqlite3.OperationalError:
        return 0, 0
    finally:
        db.close()
    return rows, done


def test_one_worker_gives_the_local_metrics_and_a_rerun_sends_nothing(fleet, local_metrics, tmp_path, capsys):
    state = tmp_path / "state.sqlite"
    code, err, got, counts = _eval(fleet, tmp_path, capsys, state)
    assert code == 0, err
    for task in local_metrics:
        assert got[task] == pytest.approx(local_metrics[task], rel=1e-9, abs=1e-12), task
    total = counts[0]
    assert counts == (total, 0) and total > 3 * LIMIT
    assert _state_counts(state) == (total, total)

    before = fleet.jobs_sent()
    code, err, again, counts = _eval(fleet, tmp_path, capsys, state)
    assert code == 0, err
    assert counts == (0, total)  # every Result reused from the state, not one job sent
    assert fleet.jobs_sent() == before
    assert again == got


def test_a_stopped_run_resumes_sending_only_the_jobs_without_a_result(fleet, local_metrics, tmp_path, capsys):
    state = tmp_path / "state.sqlite"
    worker, _, _ = fleet.procs["a"]
    # No worker answers: the run gives up at its timeout, naming the jobs still missing.
    worker.send_signal(signal.SIGSTOP)
    try:
        published = fleet.results_published()
        code, err, _, _ = _eval(fleet, tmp_path, capsys, state, tasks="tokenmill_mc", timeout=3)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert code == 3, err
    found = re.search(r"(\d+) of (\d+) job\(s\) still without a Result after waiting 3.0s; rerun the same command "
                      r"with --state \S+ to resume", err)
    assert found, err
    total = int(found[2])
    assert int(found[1]) == total == 4 * LIMIT  # four choices per question, none answered yet

    # The worker answers the stopped run's jobs while no run listens; the rerun reads those Results
    # from the results topic before it plans, and sends nothing.
    deadline = time.monotonic() + 120
    while fleet.results_published() < published + total and time.monotonic() < deadline:
        time.sleep(0.2)
    before = fleet.jobs_sent()
    code, err, got, counts = _eval(fleet, tmp_path, capsys, state, tasks="tokenmill_mc")
    assert code == 0, err
    assert counts == (0, total)
    assert fleet.jobs_sent() == before
    assert got["tokenmill_mc"] == pytest.approx(local_metrics["tokenmill_mc"], rel=1e-9, abs=1e-12)

    # Results lost from the state: exactly those jobs are sent again, the metrics are the same.
    with sqlite3.connect(state) as db:
        db.execute("DELETE FROM results WHERE job_id IN (SELECT job_id FROM rows ORDER BY row LIMIT 5)")
    before = fleet.jobs_sent()
    code, err, again, counts = _eval(fleet, tmp_path, capsys, state, tasks="tokenmill_mc")
    assert code == 0, err
    assert counts == (5, total - 5)
    assert fleet.jobs_sent() == before + 5
    assert again == got

    # Another evaluation with this state file is refused before anything is sent.
    before = fleet.jobs_sent()
    code, err, _, _ = _eval(fleet, tmp_path, capsys, state, tasks="tokenmill_mc", limit=LIMIT - 1)
    assert code == 2
    assert f"is the state of a different evaluation (limit: {LIMIT} in the state, {LIMIT - 1} now)" in err
    assert fleet.jobs_sent() == before


def test_jobs_name_the_served_model_so_another_model_is_refused(fleet, tmp_path, capsys):
    code, err, _, _ = _eval(fleet, tmp_path, capsys, tmp_path / "state.sqlite", "--served-model-name", "other-model",
                            tasks="tokenmill_mc", limit=1)
    assert code == 1
    assert "evaluation requests failed: 4 job(s) failed" in err and "other-model" in err


def test_without_state_each_run_keeps_a_new_state_and_names_it(fleet, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    states = []
    for _ in range(2):
        code, err, _, counts = _eval(fleet, tmp_path, capsys, None, tasks="tokenmill_mc", limit=1)
        assert code == 0, err
        assert counts == (4, 0)  # nothing reused from an earlier run it was not pointed at
        states.append(re.search(r"answered from the state (\S+)", err)[1])
    assert states[0] != states[1]
    assert all(str(tmp_path / "cache" / "eval") in s and os.path.isfile(s) for s in states)


def _runner(fleet, state, identity=None, **kw):
    from tokenmill.eval.kafka_runner import KafkaJobRunner
    from tokenmill.tools.backfill.kafka_backend import KafkaSettings

    settings = KafkaSettings(fleet.bootstrap, fleet.topics.jobs, fleet.topics.results, {}, fleet.model_dir.name)
    return KafkaJobRunner(settings, state, identity or {"run": "plain jobs"}, **kw)


def _jobs(runner, n: int, first_token: int = 5):
    from tokenmill.schemas import Job, Sampling

    return [Job(job_id=f"{runner.id_prefix}-gen-{i:07d}", prompt_token_ids=[first_token + i, 7, 9],
                sampling=Sampling(max_tokens=2, temperature=0.0)) for i in range(n)]


def test_the_runner_reads_results_that_came_while_no_run_listened_and_keeps_the_first_of_two(fleet, tmp_path):
    from tests.worker_helpers import produce
    from tokenmill.eval.kafka_runner import EvalIncomplete, EvalStateMismatch

    state = tmp_path / "state.sqlite"
    worker, _, _ = fleet.procs["a"]
    worker.send_signal(signal.SIGSTOP)
    try:
        published = fleet.results_published()
        runner = _runner(fleet, state, timeout_s=1.5)
        jobs = _jobs(runner, 6)
        with pytest.raises(EvalIncomplete, match=r"6 of 6 job\(s\) still without a Result after waiting 1.5s"):
            runner(jobs)
        runner.close()
    finally:
        worker.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 120
    while fleet.results_published() < published + 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = fleet.jobs_sent()
    runner = _runner(fleet, state)  # called at once: the results topic is read up to its end first
    first = runner(jobs)
    runner.close()
    assert (runner.sent, runner.reused) == (0, 6) and fleet.jobs_sent() == before
    assert all(r.status == "ok" and len(r.token_ids) == 2 for r in first.values())
    # A second Result of one job (at-least-once delivery): the first one stays.
    dup = first[jobs[0].job_id].model_dump(mode="json", exclude_none=True) | {"text": "a second answer"}
    asyncio.run(produce(fleet.bootstrap, fleet.topics.results, [dup], keys=[jobs[0].job_id.encode()]))

    runner = _runner(fleet, state)
    try:
        again = runner(jobs)
        assert (runner.sent, runner.reused) == (0, 6)
        assert fleet.jobs_sent() == before
        assert again == first and again[jobs[0].job_id].text != "a second answer"
    finally:
        runner.close()
    # Other jobs under the same ids (a task file changed) are refused, not answered from the state.
    runner = _runner(fleet, state)
    try:
        with pytest.raises(EvalStateMismatch, match="call 0 of this evaluation made other jobs than those recorded"):
            runner(_jobs(runner, 6, first_token=40))
        assert fleet.jobs_sent() == before
    finally:
        runner.close()
    with pytest.raises(EvalStateMismatch, match=r"different evaluation \(run: 'plain jobs' in the state, 'x' now\)"):
        _runner(fleet, state, {"run": "x"})


def test_two_workers_one_killed_halfway_lose_no_request(fleet, local_metrics, tmp_path, capsys):
    a, port_a, log_a = fleet.procs["a"]
    b, port_b, log_b = fleet.start("b")
    _wait_serving(b, port_b, log_b, 1)
    _wait_serving(a, port_a, log_a, 1)
    state = tmp_path / "state.sqlite"
    outcome = {}

    def run():
        outcome["eval"] = _eval(fleet, tmp_path, capsys, state)

    thread = threading.Thread(target=run)
    thread.start()
    killed_at = None
    deadline = time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline:
        # Once b has answered some jobs and the run waits for more (jobs just sent, b's share of
        # them on its partition): SIGKILL, no drain, no commit; a takes its partition over.
        counts = _state_counts(state)
        if counts[1] < counts[0] and worker_metrics(port_b).get("tokenmill_jobs_ok_total", 0) >= 1:
            b.send_signal(signal.SIGKILL)
            killed_at = counts
            break
        time.sleep(0.02)
    thread.join(240)
    assert not thread.is_alive()
    assert b.wait(10) == -signal.SIGKILL
    code, err, got, counts = outcome["eval"]
    print("killed at (jobs so far, with a Result):", killed_at, "of", counts[0])
    assert killed_at is not None, "worker b never answered a job"
    # Halfway: at the kill, jobs sent so far still lacked Results, or calls were still to come.
    assert killed_at[1] < killed_at[0] or killed_at[0] < counts[0], killed_at
    assert code == 0, err
    assert _state_counts(state) == (counts[0], counts[0])  # every job has its Result
    for task in local_metrics:
        assert got[task] == pytest.approx(local_metrics[task], rel=1e-9, abs=1e-12), task
