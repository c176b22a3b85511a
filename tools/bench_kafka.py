"""`kafka` benchmark: the `mixed` workload through a real broker and a worker, vs the engine alone.

Both sides run in this process, one after the other, on identically configured and warmed-up
engines over the same requests (`tools/bench.py`'s `mixed` workload, sent as `prompt_token_ids`
jobs with greedy sampling and ignore_eos). The Kafka side:

- the jobs are produced to a fresh jobs topic before the clock starts;
- a KafkaWorker (the same code as `tokenmill worker`, at-least-once, acks=all, commits after
  acknowledged Results) runs in-process on its own engine thread;
- the clock runs from the first job fetched to the moment the last Result was acknowledged by
  the broker (so model loading and the consumer group join are excluded, as loading is for the
  engine alone);
- afterwards a reader checks that every job has an ok Result with the requested token count.

ratio = Kafka output tok/s / engine-alone output tok/s (goal >= 0.90): what the delivery layer
costs. With `--backend vllm` both sides run vLLM behind tokenmill's adapter: what the worker costs
in front of vLLM alone. A broker is started for the run (a throw-away data directory) unless one is given.
startup_s and first_result_s are the first engine-alone run's (tools/bench_startup.py), the
broker's start left out.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import excluded, new_engine, startup_fields, startup_rows, warm_up


def _jobs(work) -> list[bytes]:
    return [
        json.dumps({
            "job_id": f"bench-{i:05d}",
            "prompt_token_ids": p,
            "sampling": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True},
        }).encode()
        for i, (p, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True))
    ]


async def _through_kafka(bootstrap: str, model_dir: Path, work, engine_options: dict[str, Any]) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from tokenmill.config import WorkerSettings
    from tokenmill.engine import EngineConfig
    from tokenmill.kafka.admin import create_topic
    from tokenmill.kafka.worker import KafkaWorker
    from tokenmill.tools.bench_engine import close_engine, engine_requests
    from tokenmill.tools.bench_workloads import warm_up_workload

    tag = os.urandom(4).hex()
    topics = {name: f"bench-{name}-{tag}" for name in ("jobs", "results", "tokens", "dlq")}
    for name in topics.values():
        await create_topic(bootstrap, name, 1)

    engine = new_engine(EngineConfig(model=str(model_dir), **engine_options))
    warm_up(engine, engine_requests(warm_up_workload(), "warm"))  # the same warm-up as the engine-alone run

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5,
                                max_request_size=8 << 20)
    await producer.start()
    try:
        futures = [await producer.send(topics["jobs"], value=v, key=f"bench-{i:05d}".encode())
                   for i, v in enumerate(_jobs(work))]
        for f in futures:
            await f
    finally:
        await producer.stop()

    settings = WorkerSettings(
        bootstrap_servers=bootstrap,
        engine=engine.config,  # the settings the engine was made with (its backend included)
        group_id=f"bench-{tag}", jobs_topic=topics["jobs"], results_topic=topics["results"],
        tokens_topic=topics["tokens"], dlq_topic=topics["dlq"], commit_interval_s=0.5,
    )
    worker = KafkaWorker(settings, engine=engine)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    n = len(work.prompts)
    deadline = time.monotonic() + 3600
    while worker.answered < n:
        if time.monotonic() > deadline:
            worker.request_stop("bench timeout")
            await task
            raise RuntimeError(f"the Kafka run answered {worker.answered} of {n} jobs within an hour")
        if task.done():
            raise RuntimeError(f"the worker stopped early: {worker.fatal_error or task.result()}")
        await asyncio.sleep(0.25)  # the worker time-stamps its first fetch and last answer itself
    (t_first, c_first), (t_last, c_last) = worker.first_fetch_at, worker.last_answer_at
    worker.request_stop("bench done")
    code = await task
    if code != 0:
        raise RuntimeError(f"the Kafka run did not finish cleanly (exit code {code})")

    reader = AIOKafkaConsumer(topics["results"], bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                              enable_auto_commit=False, fetch_max_bytes=64 << 20)
    await reader.start()
    results: dict[str, dict] = {}
    try:
        end = time.monotonic() + 60
        while len(results) < n and time.monotonic() < end:
            for recs in (await reader.getmany(timeout_ms=500)).values():
                for r in recs:
                    res = json.loads(r.value)
                    results[res["job_id"]] = res
    finally:
        await reader.stop()
    want = {f"bench-{i:05d}": m for i, m in enumerate(work.max_tokens)}
    bad = [j for j, m in want.items() if j not in results or results[j]["status"] != "ok"
           or len(results[j]["token_ids"]) != m]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs without a complete ok Result, e.g. {bad[:3]}")
    wall, cpu = t_last - t_first, c_last - c_first
    thread = worker.engine_thread
    steps, step_s = thread.steps, thread.step_seconds
    close_engine(engine)
    del engine, worker
    gc.collect()
    return {"wall_s": wall, "output_tokens": work.output_tokens, "output_tok_s": work.output_tokens / wall,
            "engine_steps": steps, "engine_step_s": step_s, "cpu_s": cpu}


def run_kafka_bench(
    model: str,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    engine_options: dict[str, Any] | None = None,
    bootstrap: str | None = None,
) -> dict[str, Any]:
    """The `kafka` workload: returns a report dict (see the module docstring)."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.bench_engine import run_engine
    from tokenmill.tools.bench_workloads import mixed_workload, resolve_model

    model_dir = resolve_model(model)
    options = dict(engine_options or {})
    options.pop("served_model_name", None)
    mc = load_model_config(model_dir)
    work = mixed_workload(mc.vocab_size, num_requests or 256, seed, set(mc.eos_token_ids))

    broker = None
    if bootstrap is None:
        from tokenmill.kafka.local_broker import LocalKafka, free_port

        broker = LocalKafka(port=free_port(), data_dir=Path(tempfile.mkdtemp(prefix="tokenmill-bench-kafka-")),
                            controller_port=free_port())
        with excluded():  # no engine command starts a broker: not part of startup_s
            broker.start(timeout=180, owner_pid=os.getpid(), auto_create_topics=False)
        bootstrap = broker.bootstrap
    try:
        # Engine alone before and after the Kafka run (the broker idles meanwhile), so a change
        # of background load on a shared machine shows up in the baseline, not only on one side.
        before = run_engine(model_dir, work, options)
        kafka = asyncio.run(_through_kafka(bootstrap, model_dir, work, options))
        after = run_engine(model_dir, work, options)
    finally:
        if broker is not None:
            broker.stop(timeout=30)
    alone_tok_s = (before.output_tok_s + after.output_tok_s) / 2
    alone_cpu_s = (before.cpu_s + after.cpu_s) / 2
    return {
        "workload": "kafka",
        "model": model,
        "backend": options.get("backend", "tokenmill"),
        "requests": len(work.prompts),
        "engine_output_tok_s": alone_tok_s,
        "engine_output_tok_s_runs": [before.output_tok_s, after.output_tok_s],
        "engine_cpu_s_runs": [before.cpu_s, after.cpu_s],
        "kafka_output_tok_s": kafka["output_tok_s"],
        "baseline": "the same engine alone, same workload (mixed), same process; mean of a run before and after",
        "baseline_output_tok_s": alone_tok_s,
        "ratio": kafka["output_tok_s"] / alone_tok_s if alone_tok_s else 0.0,
        "engine_wall_s": (before.wall_s + after.wall_s) / 2,
        "kafka_wall_s": kafka["wall_s"],
        "engine_steps": before.steps,
        # Process CPU seconds for the same work (both sides in this process; the broker's JVM is
        # not counted): on a shared machine wall time also measures the neighbours.
        "engine_cpu_s": alone_cpu_s,
        "kafka_cpu_s": kafka["cpu_s"],
        "ratio_by_cpu_time": alone_cpu_s / kafka["cpu_s"] if kafka["cpu_s"] else 0.0,
        "kafka_engine_steps": kafka["engine_steps"],
        "kafka_engine_step_s": kafka["engine_step_s"],
        "output_tokens": work.output_tokens,
        "prompt_tokens": work.prompt_tokens,
        "engine_options": options,
        **startup_fields(),
    }


def format_kafka_table(report: dict[str, Any]) -> str:
    rows = [
        ("workload", "kafka (mixed through broker + worker)"),
        ("model", report["model"]),
        ("backend", report.get("backend", "tokenmill")),
        ("requests", report["requests"]),
        ("engine alone output tok/s", f"{report['engine_output_tok_s']:.1f}  (mean of "
                                       + " and ".join(f"{x:.1f}" for x in report["engine_output_tok_s_runs"]) + ")"),
        ("through Kafka output tok/s", f"{report['kafka_output_tok_s']:.1f}  ({report['kafka_wall_s']:.1f} s)"),
        ("ratio (goal >= 0.90)", f"{report['ratio']:.3f}"),
        ("ratio by process CPU time", f"{report['ratio_by_cpu_time']:.3f}  ({report['engine_cpu_s']:.1f} s alone, "
                                      f"{report['kafka_cpu_s']:.1f} s through Kafka)"),
    ]
    rows += startup_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":  # pragma: no cover - `python -m tools.bench_kafka [MODEL] [REQUESTS]`
    import sys

    import torch

    torch.set_num_threads(1)
    from tokenmill.logging import configure_logging

    configure_logging("WARNING")
    rep = run_kafka_bench(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama",
                          num_requests=int(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(format_kafka_table(rep))
    print(json.dumps(rep))
