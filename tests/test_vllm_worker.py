"""The worker with the vllm backend against the real broker and real vLLM: the delivery is the same as on
tokenmill's own engine. Worker processes killed with kill -9 twice lose no job; a partition revoked from a
worker aborts its jobs inside vLLM; and an engine core that dies ends the worker (exit code 1) instead of
answering its jobs with errors or hanging, so the group gives them to another worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from tests.vllm_helpers import VLLM_MARKS, idle, shared_vllm_engine, vllm_model_dir
from tests.worker_helpers import (
    committed_offsets,
    end_offsets,
    job,
    log_tail,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    running_worker,
    start_worker_process,
    stop_process,
    wait_for,
    wait_ready,
    worker_command,
    worker_metrics,
    worker_settings,
)

pytestmark = [*VLLM_MARKS, pytest.mark.kafka, pytest.mark.slow]

# The engine flags of every vLLM worker process here: eager (no torch.compile at start) and room for
# the jobs' KV cache.
VLLM_FLAGS = ("--backend", "vllm", "--cuda-graphs", "off", "--kv-cache-gb", "0.25")


async def _when_mid_work(port: int, ok_before: float, timeout: float = 120) -> None:
    """Returns once the worker has answered some new jobs and has more in its engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(worker_metrics, port)
        if m["tokenmill_jobs_ok_total"] >= ok_before + 3 and m["tokenmill_engine_running"] + m[
                "tokenmill_engine_waiting"] > 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the worker never had answered and running jobs at once")


def _vllm_worker(bootstrap, topics, port: int, *extra: str) -> list[str]:
    return worker_command(bootstrap, topics, vllm_model_dir(), *VLLM_FLAGS, "--metrics-port", str(port),
                          "--commit-interval", "1.0", "--instance-id", f"vllm-{topics.group}", *extra)


async def test_a_vllm_worker_killed_twice_with_kill_9_loses_no_job(kafka_bootstrap, tmp_path):
    """A worker process, started again after the first of two kill -9s that land while it has answered
    some jobs and runs others; after the second, a worker in this process (vLLM too) takes over. Every
    job ends with one ok Result or more, and every offset is committed."""
    from tokenmill.kafka.local_broker import free_port

    topics = await make_topics(kafka_bootstrap, "vllm-kill", partitions=2)
    port, log = free_port(), tmp_path / "worker.log"
    cmd = _vllm_worker(kafka_bootstrap, topics, port, "--max-crash-attempts", "4")
    waves = [[job(i, max_tokens=48 if i % 3 else 96) for i in range(w * 60, (w + 1) * 60)] for w in range(3)]
    ids = {j["job_id"] for wave in waves for j in wave}
    proc = start_worker_process(cmd, log)
    try:
        for wave in waves[:2]:
            await wait_ready(proc, port, log, timeout=240, interval=0.5)
            ok_before = (await asyncio.to_thread(worker_metrics, port))["tokenmill_jobs_ok_total"]
            await produce(kafka_bootstrap, topics.jobs, wave)
            await _when_mid_work(port, ok_before)
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: vLLM's own processes too
            assert proc.wait(30) == -signal.SIGKILL
            if wave is waves[0]:
                proc = start_worker_process(cmd, log)
    finally:
        stop_process(proc, signal.SIGKILL)
    await produce(kafka_bootstrap, topics.jobs, waves[2])
    engine = shared_vllm_engine(vllm_model_dir())
    settings = worker_settings(kafka_bootstrap, topics, vllm_model_dir(), max_crash_attempts=4)
    settings.engine = engine.config
    async with running_worker(settings, engine):
        records = await read_topic(kafka_bootstrap, topics.results, lambda r: {x.key.decode() for x in r} >= ids,
                                   timeout=240)
    results = results_by_job(records)
    missing = ids - set(results)
    assert not missing, f"{len(missing)} jobs lost, e.g. {sorted(missing)[:5]}; {log_tail(log)}"
    assert all(r["status"] == "ok" for rs in results.values() for r in rs)
    assert await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 2) == \
        await end_offsets(kafka_bootstrap, topics.jobs, 2)
    duplicates = sum(len(rs) - 1 for rs in results.values())
    print(f"\nvLLM worker, 180 jobs, 2 x kill -9: 0 lost, {duplicates} duplicate Results")


async def test_a_revoked_partition_has_its_jobs_aborted_inside_vllm(kafka_bootstrap):
    """Worker a (vLLM) runs four long jobs of each of two partitions; worker b (tokenmill's own engine)
    joins and takes one partition: a's vLLM engine then holds only the four jobs of the partition it
    kept, and nothing once a stops."""
    from tokenmill.engine.engine import Engine, EngineConfig

    model_dir = vllm_model_dir()
    engine = shared_vllm_engine(model_dir)
    real_step = engine.step

    def slow_step():  # long jobs stay in flight through the rebalance
        time.sleep(0.03)
        return real_step()

    engine.step = slow_step
    topics = await make_topics(kafka_bootstrap, "vllm-revoke", partitions=2)
    jobs = [job(i, max_tokens=1500) for i in range(8)]
    await produce(kafka_bootstrap, topics.jobs, jobs[:4], partition=0)
    await produce(kafka_bootstrap, topics.jobs, jobs[4:], partition=1)
    a = worker_settings(kafka_bootstrap, topics, model_dir, drain_timeout_s=0.0, worker_name="a")
    a.engine = engine.config
    b = worker_settings(kafka_bootstrap, topics, model_dir, drain_timeout_s=0.0, worker_name="b")
    own = Engine(EngineConfig(model=model_dir, max_num_seqs=16, kv_cache_gb=0.05))
    try:
        async with running_worker(a, engine) as (wa, _):
            await wait_for(lambda: engine.held_state()["vllm_unfinished"] == 8, 60, what="8 jobs in vLLM")
            async with running_worker(b, own) as (wb, _):
                await wait_for(lambda: len(wa.tracker.partitions()) == 1 == len(wb.tracker.partitions()), 60,
                               what="one partition each")
                await wait_for(lambda: engine.held_state()["vllm_unfinished"] == 4, 30,
                               what="the revoked partition's jobs aborted in vLLM")
                assert engine.held_state()["requests"] == 4 and wa.answered == 0
    finally:
        engine.step = real_step
    # A stopped worker's engine thread ends with its last aborts maybe still queued (its process would
    # exit now); this engine is shared, so what it holds is ended here: the kept partition's jobs at most.
    left = engine.request_ids
    assert len(left) <= 4
    for rid in left:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    assert idle(engine)


async def test_a_dead_engine_core_ends_the_worker_and_its_jobs_go_to_another(kafka_bootstrap, tmp_path):
    """vLLM's engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1), killed while jobs run: the
    worker exits with code 1 within a minute, publishes no Result for the jobs it had, and leaves their
    offsets uncommitted; a worker started after answers every job."""
    import psutil

    from tokenmill.kafka.local_broker import free_port

    topics = await make_topics(kafka_bootstrap, "vllm-dead", partitions=1)
    # Long enough (1,500 steps: 600 took 7 s alone on the AVX2 EPYC and some 3 s on a Zen 5 one, where
    # two full runs saw no running job) to be still running when the core is killed, just after the
    # first is seen running; the worker that answers them after runs them all.
    jobs = [job(i, max_tokens=1500) for i in range(6)]
    port, log = free_port(), tmp_path / "worker.log"
    cmd = _vllm_worker(kafka_bootstrap, topics, port, "--log-level", "INFO")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        proc = start_worker_process(cmd, log)
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    try:
        # vLLM is imported twice here (the worker, then its engine core's process): on a loaded 2-core
        # machine each import alone has taken 100 s.
        await wait_ready(proc, port, log, timeout=600, interval=0.5)
        # The jobs go in once the worker is ready: produced before, a fast CPU could answer them all
        # between two readiness polls, and no job would be running to kill the core under.
        await produce(kafka_bootstrap, topics.jobs, jobs)
        await wait_for(lambda: worker_metrics(port)["tokenmill_engine_running"] > 0, 60, what="jobs running")
        cores = [c for c in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in " ".join(
            c.cmdline() + [c.name()])]
        assert cores, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        t0 = time.monotonic()
        for core in cores:
            core.send_signal(signal.SIGKILL)
        try:
            code = await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within 60 s of its engine core's death; its log:\n{log_tail(log)}")
        seconds = time.monotonic() - t0
    finally:
        stop_process(proc, signal.SIGKILL)
    assert code == 1, log_tail(log)
    assert seconds < 60  # 5-20 s here: the watchdog sees the death within a second, the rest is the drain and exit
    assert "engine failed" in log.read_text(errors="replace")
    published = results_by_job(await read_topic(kafka_bootstrap, topics.results, lambda r: False, timeout=2))
    assert all(r["status"] == "ok" for rs in published.values() for r in rs)  # no job answered with an error
    committed = (await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1))[0]
    assert (committed or 0) < len(jobs)
    # Another worker (vLLM in this process) answers every job.
    settings = worker_settings(kafka_bootstrap, topics, vllm_model_dir())
    engine = shared_vllm_engine(vllm_model_dir())
    settings.engine = engine.config
    ids = {j["job_id"] for j in jobs}
    async with running_worker(settings, engine):
        records = await read_topic(kafka_bootstrap, topics.results, lambda r: {x.key.decode() for x in r} >= ids,
                                   timeout=120)
    results = results_by_job(records)
    assert set(results) == ids and all(r["status"] == "ok" for rs in results.values() for r in rs)
    print(f"\ndead vLLM core: the worker exited (code 1) {seconds:.1f} s after the kill; "
          f"{len(ids) - len(published)} of {len(ids)} jobs redelivered and answered")
