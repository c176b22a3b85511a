"""Workers as subprocesses against the real broker: SIGTERM drain, kill -9 crashes (at-least-once
and exactly-once), a broker restart in the middle of a run, a job that kills its worker each time."""

import asyncio
import json
import os
import signal
import sys
import time

import pytest

from tests.worker_helpers import (
    committed_offsets,
    end_offsets,
    job,
    log_tail,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    start_worker_process,
    stop_process,
    wait_ready,
    worker_command,
    worker_metrics,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def _results(bootstrap, topic, n_jobs, timeout, read_committed=False):
    recs = await read_topic(bootstrap, topic, lambda r: len({x.key for x in r}) >= n_jobs, timeout, read_committed)
    return results_by_job(recs)


async def _wait_some_results(bootstrap, topic, job_ids: set[str], at_least: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = await read_topic(bootstrap, topic, lambda r: False, timeout=0.5)
        done = {r.key.decode() for r in recs} & job_ids
        if len(done) >= at_least:
            return done
    raise TimeoutError(f"fewer than {at_least} results within {timeout}s")


async def test_sigterm_finishes_in_flight_jobs_commits_and_exits_0(kafka_bootstrap, tiny_llama_dir, tmp_path):
    topics = await make_topics(kafka_bootstrap, "sigterm", partitions=1)
    # Enough jobs that the signal surely lands mid-run: the tiny model answers ~200 jobs a second,
    # faster than this test sees the first Result (with 120 jobs the worker had sometimes fetched
    # them all before the signal arrived).
    jobs = [job(i, max_tokens=24) for i in range(1000)]
    await produce(kafka_bootstrap, topics.jobs, jobs)
    log = tmp_path / "worker.log"
    proc = start_worker_process(
        worker_command(kafka_bootstrap, topics, tiny_llama_dir, "--max-inflight-per-partition", "40",
                       "--max-num-seqs", "8", "--log-level", "INFO"), log)
    try:
        ids = {j["job_id"] for j in jobs}
        before = await _wait_some_results(kafka_bootstrap, topics.results, ids, 1, timeout=90)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    finally:
        stop_process(proc, signal.SIGKILL)
    assert code == 0, log_tail(log)
    committed = (await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1))[0]
    results = results_by_job(await read_topic(kafka_bootstrap, topics.results, lambda r: False, timeout=2))
    offsets = sorted(r[0]["source"]["offset"] for r in results.values())
    # Everything fetched before the signal was finished and committed; nothing after it started.
    assert committed is not None and committed < len(jobs), "the worker should have stopped fetching"
    assert offsets == list(range(committed)), (committed, offsets[-5:])
    assert len(results) >= len(before)
    assert all(len(r) == 1 and r[0]["status"] == "ok" for r in results.values())
    drained = [json.loads(line) for line in log.read_text().splitlines() if '"event": "drained"' in line]
    assert drained and drained[0]["abandoned"] == 0


async def _metrics_of(proc, port: int, log) -> dict[str, float]:
    """The worker's metrics; a worker that stopped answering is reported with its state and log."""
    try:
        return await asyncio.to_thread(worker_metrics, port)
    except OSError as exc:
        await asyncio.sleep(1)  # an exit just now: let its code and last lines arrive
        raise AssertionError(f"worker's /metrics on port {port} failed ({exc!r}); exit code {proc.poll()}; "
                             f"its log: {log_tail(log)}") from exc


async def _kill_mid_work(proc, port: int, log, ok_before: float, timeout: float = 30) -> float:
    """SIGKILL once the worker has answered some of the new jobs and still runs others; returns
    how many requests were in its engine at that moment."""
    deadline = time.monotonic() + timeout
    seen = []  # (answered, in the engine) at each poll, for the message if the moment never comes
    while time.monotonic() < deadline:
        m = await _metrics_of(proc, port, log)
        load = m["tokenmill_engine_running"] + m["tokenmill_engine_waiting"]
        if m["tokenmill_jobs_ok_total"] >= ok_before + 3 and load > 0:
            proc.send_signal(signal.SIGKILL)
            return load
        seen.append((m["tokenmill_jobs_ok_total"] - ok_before, load))
        await asyncio.sleep(0.02)
    polls = sorted(set(seen), key=seen.index)
    raise AssertionError(f"the worker never had answered and running jobs at once; (answered, in the engine) "
                         f"seen: {polls[:40]}; its log: {log_tail(log)}")


async def _crash_run(bootstrap, model_dir, tmp_path, exactly_once: bool):
    """2 workers; 500 jobs in 5 waves; during each of the middle 3 waves one worker is killed with
    SIGKILL once it has answered some of the wave and is still running more of it, restarted, and
    the next wave waits until it is ready again, so the group always has 2 members to lose."""
    from tokenmill.kafka.local_broker import free_port

    n_jobs, per_wave, kills = 500, 100, 3
    topics = await make_topics(bootstrap, "crash-eos" if exactly_once else "crash", partitions=4)
    extra = ["--exactly-once"] if exactly_once else []
    ports = {name: free_port() for name in "ab"}

    def cmd(name):
        # The default commit interval (1 s), so a kill finds answered but not yet committed jobs.
        # One crash attempt more than there are kills: with the default of 3, a job that happens to
        # be in the engine at all 3 kills is rightly dead-lettered as a job of death. That does
        # happen on a slow machine: jobs a killed worker had begun are counted once, their partition
        # goes to the worker killed next, which has them begun behind its full batch when it dies
        # (counted twice), and the third kill lands while one of them runs alone as a suspect
        # (starts.py). This test is about losing and duplicating nothing; the dead-lettering has
        # its own tests (test_a_job_that_kills_its_worker_every_time_..., test_crash_attempts.py).
        return worker_command(bootstrap, topics, model_dir, *extra, "--max-num-seqs", "32",
                              "--metrics-port", str(ports[name]), "--commit-interval", "1.0",
                              "--max-crash-attempts", str(kills + 1))

    logs = {name: tmp_path / f"{name}.log" for name in "ab"}
    procs = {name: start_worker_process(cmd(name), logs[name]) for name in "ab"}
    forms = ("prompt", "messages", "tokens")
    # In the waves with a kill, one job in five is short: it is answered while the long jobs that
    # share its batch still run, so the moment to kill comes however the wave's partitions fell
    # to the two workers (a worker whose share fits one batch, all long, finishes it in one step).
    all_jobs = [job(i, forms[i % 3], stream=(i % 10 == 0),
                    max_tokens=160 if 100 <= i < 400 and i % 5 else 8)
                for i in range(n_jobs)]
    waves = [all_jobs[i:i + per_wave] for i in range(0, n_jobs, per_wave)]
    killed = 0
    try:
        for name in "ab":
            await wait_ready(procs[name], ports[name], logs[name])
        for w, wave in enumerate(waves):
            name = "ab"[killed % 2]
            if 1 <= w <= kills:
                ok_before = (await _metrics_of(procs[name], ports[name], logs[name]))["tokenmill_jobs_ok_total"]
            await produce(bootstrap, topics.jobs, wave)
            if 1 <= w <= kills:
                # Killed while it has answered some of this wave and is running more of it.
                await _kill_mid_work(procs[name], ports[name], logs[name], ok_before)
                assert procs[name].wait(30) == -signal.SIGKILL
                killed += 1
                procs[name] = start_worker_process(cmd(name), logs[name])
                await wait_ready(procs[name], ports[name], logs[name])
        results = await _results(bootstrap, topics.results, n_jobs, timeout=240, read_committed=exactly_once)
        for name, proc in procs.items():
            assert proc.poll() is None, f"worker {name} exited: {log_tail(logs[name])}"
    finally:
        codes = {name: stop_process(p) for name, p in procs.items()}
    assert killed == kills
    assert codes == {"a": 0, "b": 0}, {n: log_tail(logs[n]) for n in procs}
    missing = {j["job_id"] for j in all_jobs} - set(results)
    assert not missing, f"{len(missing)} jobs without a Result, e.g. {sorted(missing)[:5]}"
    duplicates = sum(len(v) - 1 for v in results.values())
    assert all(r["status"] == "ok" for v in results.values() for r in v)
    committed = await committed_offsets(bootstrap, topics.group, topics.jobs, 4)
    assert committed == await end_offsets(bootstrap, topics.jobs, 4)
    return topics, results, duplicates


async def test_crash_kill_9_at_least_once(kafka_bootstrap, tiny_llama_dir, tmp_path):
    topics, results, duplicates = await _crash_run(kafka_bootstrap, tiny_llama_dir, tmp_path, exactly_once=False)
    print(f"\nat-least-once crash test: 500 jobs, 3 x kill -9: {duplicates} duplicate Results")


async def test_crash_kill_9_exactly_once_read_committed(kafka_bootstrap, tiny_llama_dir, tmp_path):
    topics, results, duplicates = await _crash_run(kafka_bootstrap, tiny_llama_dir, tmp_path, exactly_once=True)
    uncommitted = results_by_job(await read_topic(kafka_bootstrap, topics.results, lambda r: False, timeout=2))
    raw_dups = sum(len(v) - 1 for v in uncommitted.values())
    print(f"\nexactly-once crash test: 500 jobs, 3 x kill -9: {duplicates} duplicates for read_committed, "
          f"{raw_dups} records of aborted transactions seen by read_uncommitted")
    assert duplicates == 0
    assert all(len(v) == 1 for v in results.values())


async def test_broker_restart_mid_run_loses_nothing(tiny_llama_dir, tmp_path):
    from tokenmill.kafka.local_broker import LocalKafka, free_port

    broker = LocalKafka(port=free_port(), data_dir=tmp_path / "kafka", controller_port=free_port())
    broker.start(timeout=180, owner_pid=os.getpid(), auto_create_topics=False)
    proc = None
    try:
        bootstrap = broker.bootstrap
        topics = await make_topics(bootstrap, "restart", partitions=2)
        first = [job(i, max_tokens=12) for i in range(100)]
        second = [job(i, max_tokens=12) for i in range(100, 160)]
        await produce(bootstrap, topics.jobs, first)
        proc = start_worker_process(worker_command(bootstrap, topics, tiny_llama_dir, "--instance-id", "restart-w1"),
                                    tmp_path / "w.log")
        await _wait_some_results(bootstrap, topics.results, {j["job_id"] for j in first}, 20, timeout=90)
        await asyncio.to_thread(broker.stop, 60)
        await asyncio.sleep(4)  # the worker keeps generating, publishing fails and retries
        assert proc.poll() is None, log_tail(tmp_path / "w.log")
        await asyncio.to_thread(broker.start, 180, os.getpid(), False)
        await produce(bootstrap, topics.jobs, second)
        results = await _results(bootstrap, topics.results, 160, timeout=180)
        assert proc.poll() is None, "the worker exited during the broker restart"
        missing = {j["job_id"] for j in first + second} - set(results)
        assert not missing, f"lost {len(missing)} jobs: {sorted(missing)[:5]}"
        assert stop_process(proc) == 0, log_tail(tmp_path / "w.log")
        proc = None
        assert await committed_offsets(bootstrap, topics.group, topics.jobs, 2) == await end_offsets(
            bootstrap, topics.jobs, 2)
    finally:
        if proc is not None:
            stop_process(proc, signal.SIGKILL)
        broker.stop(timeout=30)


KILL_PROMPT = "this job kills the worker process"


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
async def test_a_job_that_kills_its_worker_every_time_is_dead_lettered_after_3_attempts(
        kafka_bootstrap, tiny_llama_dir, tmp_path, exactly_once):
    """One partition, 30 jobs; the engine of the worker (tests/killing_worker.py) SIGKILLs its own
    process whenever job 5 is in a step. The worker is restarted after each death until every job
    is answered: job 5 runs 3 times, then is dead-lettered as crashed_worker; the others are ok.
    Exactly-once: the counts travel in the transactions' offset commits."""
    n_jobs, killer = 30, 5
    topics = await make_topics(kafka_bootstrap, "killer-eos" if exactly_once else "killer", partitions=1)
    jobs = [job(i, max_tokens=4) for i in range(n_jobs)]
    jobs[killer]["prompt"] = KILL_PROMPT
    killer_id = jobs[killer]["job_id"]
    await produce(kafka_bootstrap, topics.jobs, jobs)
    ran, log = tmp_path / "killer-ran", tmp_path / "worker.log"
    # Static membership: a restarted worker takes the partition over at once, no session timeout.
    extra = ["--exactly-once"] if exactly_once else []
    flags = worker_command(kafka_bootstrap, topics, tiny_llama_dir, "--instance-id", "killer-w1",
                           "--log-level", "INFO", *extra)[3:]
    cmd = [sys.executable, "-m", "tests.killing_worker", str(ran), KILL_PROMPT, *flags]
    ids = {j["job_id"] for j in jobs}
    t0, deaths, results = time.monotonic(), 0, {}
    proc = start_worker_process(cmd, log)
    try:
        while time.monotonic() - t0 < 150:
            if proc.poll() is not None:
                assert proc.returncode == -signal.SIGKILL, log_tail(log)
                deaths += 1
                assert deaths <= 3, f"the killer ran more than 3 times: {ran.read_text()}"
                proc = start_worker_process(cmd, log)
            results = results_by_job(await read_topic(kafka_bootstrap, topics.results,
                                                      lambda r: {x.key.decode() for x in r} >= ids, timeout=1.0,
                                                      read_committed=exactly_once))
            if set(results) >= ids:
                break
        assert set(results) >= ids, f"no Result for {sorted(ids - set(results))} after {deaths} deaths"
        assert proc.poll() is None, log_tail(log)
    finally:
        code = stop_process(proc)
    seconds = time.monotonic() - t0
    assert code == 0, log_tail(log)
    assert deaths == 3 and len(ran.read_text().splitlines()) == 3
    (answer,) = results[killer_id]
    assert (answer["status"], answer["error"]["code"]) == ("error", "crashed_worker"), answer
    assert answer["source"]["offset"] == killer
    others = [r for job_id, rs in results.items() if job_id != killer_id for r in rs]
    assert all(r["status"] == "ok" for r in others)
    dead = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 1, timeout=5,
                            read_committed=exactly_once)
    assert [(r.value, dict(r.headers)["tokenmill.error.code"]) for r in dead] == [
        (json.dumps(jobs[killer]).encode(), b"crashed_worker")]
    assert await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1) == {0: n_jobs}
    alone = sum('"event": "a job that was in flight when workers died runs alone"' in line
                for line in log.read_text(errors="replace").splitlines())
    if exactly_once:
        assert len(others) == n_jobs - 1  # a read_committed reader sees one Result per job
    print(f"\njob of death ({'exactly' if exactly_once else 'at least'} once): 3 deaths, killer dead-lettered; "
          f"{alone} runs alone; "
          f"{len(others)} ok Results for {n_jobs - 1} other jobs; {seconds:.0f} s")
