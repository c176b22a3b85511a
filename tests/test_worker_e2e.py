"""The worker against the real broker, in-process (one shared tiny engine): end to end, poison
inputs, the bad-input guard, expired deadlines, the tenant cap."""

import asyncio
import json
import time

import pytest

from tests.worker_helpers import (
    committed_offsets,
    count_unique_jobs,
    end_offsets,
    job,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    running_worker,
    worker_settings,
)

pytestmark = [pytest.mark.kafka]

MAX_MODEL_LEN = 256  # small, so an over-long prompt is cheap to build


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tokenmill.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=64, max_num_batched_tokens=1024,
                               kv_cache_gb=0.05, max_model_len=MAX_MODEL_LEN))


def _http(port, path):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _stream_events(records) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        ev = json.loads(r.value)
        assert r.key.decode() == ev["job_id"]
        out.setdefault(ev["job_id"], []).append(ev)
    return out


async def test_end_to_end_200_jobs_exactly_one_ok_result_each(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "e2e", partitions=2)
    forms = ("prompt", "messages", "tokens")
    jobs = [job(i, forms[i % 3], stream=(i % 4 == 0), max_tokens=4 + i % 5) for i in range(200)]
    jobs[7]["sampling"]["logprobs"] = 2
    await produce(kafka_bootstrap, topics.jobs, jobs)
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, metrics_port=0)
    async with running_worker(settings, engine) as (w, task):
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(200), timeout=120)
        await asyncio.sleep(1.0)  # a late duplicate would show up here
        records = await read_topic(kafka_bootstrap, topics.results, lambda r: False, timeout=1.5)
        metrics, ready = await asyncio.to_thread(_http, w.metrics_port, "/metrics"), await asyncio.to_thread(
            _http, w.metrics_port, "/readyz")
        assert ready == (200, "ok\n")
        assert "tokenmill_jobs_ok_total 200.0" in metrics[1] and "tokenmill_jobs_in_total 200.0" in metrics[1], (
            [line for line in metrics[1].splitlines() if line.startswith("tokenmill_")])
        assert f'tokenmill_commit_lag{{partition="0",topic="{topics.jobs}"}} 0.0' in metrics[1]
        assert "tokenmill_ttft_ms_count 200.0" in metrics[1]
    assert task.result() == 0
    results = results_by_job(records)
    assert sorted(results) == sorted(j["job_id"] for j in jobs)
    assert all(len(v) == 1 for v in results.values()), "a job was answered twice without any failure"
    by_id = {j["job_id"]: j for j in jobs}
    for job_id, (res,) in results.items():
        assert res["status"] == "ok", res
        assert len(res["token_ids"]) == by_id[job_id]["sampling"]["max_tokens"]  # ignore_eos
        assert res["source"]["topic"] == topics.jobs
    assert len(results["job-00007"][0]["logprobs"]) == len(results["job-00007"][0]["token_ids"])

    # Every streamed job's events: one attempt, gap-free indexes, last one finished, and the pieces
    # add up to exactly the Result's text and token ids.
    events = _stream_events(await read_topic(kafka_bootstrap, topics.tokens, lambda r: False, timeout=2))
    streamed = [j["job_id"] for j in jobs if j["stream"]]
    assert sorted(events) == sorted(streamed)
    for job_id in streamed:
        evs = events[job_id]
        res = results[job_id][0]
        assert {e["attempt"] for e in evs} == {res["attempt"]}
        assert [e["index"] for e in evs] == list(range(len(evs)))
        assert evs[-1]["finished"] and not any(e["finished"] for e in evs[:-1])
        assert "".join(e["text"] for e in evs) == res["text"]
        assert [t for e in evs for t in e["token_ids"]] == res["token_ids"]

    # Committed offsets reach the end of both partitions.
    assert await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 2) == await end_offsets(
        kafka_bootstrap, topics.jobs, 2)


def _poison_kinds(i: int, served: str) -> list[tuple[str, bytes | None]]:
    """(kind, raw value) of every invalid input kind; i makes job ids unique."""
    jid = f"bad-{i:05d}"
    valid = {"job_id": jid, "prompt": "hello", "sampling": {"max_tokens": 2}}

    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    return [
        ("not_json", b"{this is not json"),
        ("invalid_utf8", b'{"job_id": "' + jid.encode() + b'", "prompt": "\xff\xfe"}'),
        ("wrong_types", js({**valid, "sampling": {"max_tokens": "many"}, "stream": "yes"})),
        ("missing_job_id", js({"prompt": "hello"})),
        ("unknown_field", js({**valid, "promt": "typo"})),
        ("empty_prompt", js({**valid, "prompt": ""})),
        ("over_long_prompt", js({**valid, "prompt": None, "prompt_token_ids": [5] * (MAX_MODEL_LEN + 40)})),
        ("huge_metadata", js({**valid, "metadata": {"blob": "x" * 20_000}})),
        ("negative_max_tokens", js({**valid, "sampling": {"max_tokens": -3}})),
        ("wrong_model", js({**valid, "model": served + "-other"})),
        ("json_array", js([valid])),
        ("tombstone", None),
        ("token_id_out_of_vocab", js({**valid, "prompt": None, "prompt_token_ids": [1, 10_000_000]})),
    ]


async def test_poison_inputs_never_block_the_partition(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "poison", partitions=1)
    served = engine.served_model_name
    values, kinds, valid_ids, bad_offsets = [], [], [], {}
    n_kinds = len(_poison_kinds(0, served))
    for i in range(312):  # 312 invalid inputs, 24 of each of the 13 kinds, and 104 valid jobs
        kind, raw = _poison_kinds(i, served)[i % n_kinds]
        bad_offsets[len(values)] = kind
        values.append(raw)
        kinds.append(kind)
        if i % 3 == 2:
            valid = job(10_000 + i, ("prompt", "messages", "tokens")[i % 3], max_tokens=3)
            valid_ids.append(valid["job_id"])
            values.append(json.dumps(valid).encode())
    expired = job(99_999, deadline_ms=int(time.time() * 1000) - 60_000)
    values.append(json.dumps(expired).encode())
    keys = [f"k{i}".encode() for i in range(len(values))]
    await produce(kafka_bootstrap, topics.jobs, values, partition=0, keys=keys)

    async with running_worker(worker_settings(kafka_bootstrap, topics, tiny_llama_dir), engine) as (w, task):
        dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= len(bad_offsets), timeout=120)
        end = (await end_offsets(kafka_bootstrap, topics.jobs, 1))[0]

        async def committed_to_end():
            return (await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1))[0] == end

        deadline = time.monotonic() + 60
        while not await committed_to_end():
            assert time.monotonic() < deadline, "the committed offset never reached the end of the partition"
            await asyncio.sleep(0.3)
        results = results_by_job(await read_topic(kafka_bootstrap, topics.results, lambda r: False, timeout=2))
    assert task.result() == 0

    # Each invalid input is in the DLQ once, bytes unchanged, with the reason and its source.
    assert len(dlq) == len(bad_offsets) == 312
    seen = {}
    for rec in dlq:
        h = {k: v.decode() for k, v in rec.headers}
        off = int(h["tokenmill.source.offset"])
        assert h["tokenmill.source.topic"] == topics.jobs and h["tokenmill.source.partition"] == "0"
        assert rec.value == values[off] and rec.key == keys[off]
        assert h["tokenmill.error.code"] and h["tokenmill.error.message"]
        seen[off] = h["tokenmill.error.code"]
    assert set(seen) == set(bad_offsets)
    codes_by_kind = {}
    for off, kind in bad_offsets.items():
        codes_by_kind.setdefault(kind, set()).add(seen[off])
    assert codes_by_kind["wrong_model"] == {"model_mismatch"}
    assert codes_by_kind["over_long_prompt"] == {"prompt_too_long"}
    assert all(codes == {"invalid_job"} for kind, codes in codes_by_kind.items()
               if kind not in ("wrong_model", "over_long_prompt"))

    # Every valid job: one ok Result. Invalid ones with a readable job_id: an error Result.
    for jid in valid_ids:
        assert [r["status"] for r in results[jid]] == ["ok"]
    assert [r["status"] for r in results[expired["job_id"]]] == ["expired"]
    readable = {"wrong_types", "unknown_field", "empty_prompt", "over_long_prompt", "huge_metadata",
                "negative_max_tokens", "wrong_model", "token_id_out_of_vocab"}
    for i, kind in enumerate(kinds):
        jid = f"bad-{i:05d}"
        if kind in readable:
            assert [r["status"] for r in results.get(jid, [])] == ["error"], (kind, results.get(jid))
        else:
            assert jid not in results
    assert w.metrics.jobs_dead_lettered.labels("invalid_job")._value.get() == 24 * 11


async def test_guard_stops_the_worker_when_most_inputs_are_bad(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "guard", partitions=1)
    await produce(kafka_bootstrap, topics.jobs, [b"not json"] * 40)
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, bad_input_ratio=0.8, bad_input_window=20)
    from tokenmill.kafka.worker import KafkaWorker

    w = KafkaWorker(settings, engine=engine)
    code = await asyncio.wait_for(w.run(install_signal_handlers=False), 60)
    assert code == 3
    assert "20 of the last 20 inputs were invalid (invalid_job: 20)" in w.fatal_error
    # What was dead-lettered before the stop is committed; the rest waits in Kafka.
    committed = (await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 1))[0]
    dlq = await read_topic(kafka_bootstrap, topics.dlq, lambda r: False, timeout=1.5)
    assert committed is not None and 20 <= committed < 40 and len(dlq) >= committed


async def test_tenant_cap_limits_concurrent_jobs_of_a_tenant(kafka_bootstrap, tiny_llama_dir, engine):
    topics = await make_topics(kafka_bootstrap, "tenant", partitions=1)
    jobs = [job(i, max_tokens=8, tenant="a" if i % 2 else "b") for i in range(40)]
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, max_inflight_per_tenant=2)
    peak = {"a": 0, "b": 0}
    async with running_worker(settings, engine) as (w, task):
        async def sample():
            while True:
                for t in peak:
                    peak[t] = max(peak[t], w.tenants.running(t))
                await asyncio.sleep(0)

        sampler = asyncio.create_task(sample())
        await produce(kafka_bootstrap, topics.jobs, jobs)  # only now: the sampler sees every job
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(40), timeout=90)
        sampler.cancel()
    results = results_by_job(records)
    assert len(results) == 40 and all(r[0]["status"] == "ok" for r in results.values())
    assert peak == {"a": 2, "b": 2}


async def test_kafka_bench_runs_end_to_end(kafka_bootstrap, tiny_llama_dir):
    """The `kafka` bench on a handful of requests: it checks every Result itself and reports."""
    from tokenmill.tools.bench_kafka import run_kafka_bench

    report = await asyncio.to_thread(run_kafka_bench, str(tiny_llama_dir), num_requests=6,
                                     bootstrap=kafka_bootstrap, engine_options={"kv_cache_gb": 0.05})
    assert report["workload"] == "kafka" and report["requests"] == 6
    assert report["kafka_output_tok_s"] > 0 and report["engine_output_tok_s"] > 0
    assert report["ratio"] == pytest.approx(report["kafka_output_tok_s"] / report["engine_output_tok_s"])


async def test_backpressure_and_span_cap_pause_fetching_without_losing_jobs(kafka_bootstrap, tiny_llama_dir, engine):
    from tokenmill.kafka.backpressure import BackpressurePolicy

    topics = await make_topics(kafka_bootstrap, "backpressure", partitions=1)
    jobs = [job(i, max_tokens=6, tenant="t") for i in range(80)]
    # Jobs held by the tenant cap count as waiting, so the gate sees up to 10 waiting jobs.
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, max_inflight_per_partition=12,
                               max_inflight_per_tenant=2,
                               backpressure=BackpressurePolicy(waiting_high=4, waiting_low=2))
    seen = {"gate_paused": False, "span_paused": False, "max_span": 0}
    async with running_worker(settings, engine) as (w, task):
        async def sample():
            while True:
                seen["gate_paused"] |= w.gate.paused
                seen["span_paused"] |= bool(w.fetcher.span_paused)
                for tp in w.tracker.partitions():
                    seen["max_span"] = max(seen["max_span"], w.tracker.get(tp).span())
                await asyncio.sleep(0)

        sampler = asyncio.create_task(sample())
        await produce(kafka_bootstrap, topics.jobs, jobs)
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(80), timeout=90)
        sampler.cancel()
    results = results_by_job(records)
    assert len(results) == 80 and all(len(r) == 1 and r[0]["status"] == "ok" for r in results.values())
    assert seen["gate_paused"] and seen["span_paused"]
    assert 0 < seen["max_span"] <= 12  # the span cap is exact: the record over it is fetched again later


async def test_an_n_job_streams_each_choice_and_gets_its_choices(kafka_bootstrap, tiny_llama_dir, engine):
    """sampling.n > 1 through the worker: one Result with n choices; the TokenEvents of each choice
    (named by `choice`, gap-free `index` over the attempt) rebuild that choice's text and tokens."""
    topics = await make_topics(kafka_bootstrap, "e2e-n", partitions=1)
    jobs = [job(i, stream=(i < 2), max_tokens=5) for i in range(3)]
    for i, j in enumerate(jobs):
        j["sampling"].update(n=3, temperature=0.9, seed=50 + i)
    await produce(kafka_bootstrap, topics.jobs, jobs)
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, metrics_port=0)
    async with running_worker(settings, engine):
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(3), timeout=60)
    results = {job_id: res for job_id, (res, *_) in results_by_job(records).items()}
    events = _stream_events(await read_topic(kafka_bootstrap, topics.tokens, lambda r: False, timeout=2))
    assert sorted(events) == ["job-00000", "job-00001"]
    for job_id, res in results.items():
        assert res["status"] == "ok" and [c["index"] for c in res["choices"]] == [0, 1, 2]
        assert res["usage"]["completion_tokens"] == 15 and res["text"] == res["choices"][0]["text"]
        evs = events.get(job_id)
        if evs is None:
            continue
        assert [e["index"] for e in evs] == list(range(len(evs)))
        assert evs[-1]["finished"] and not any(e["finished"] for e in evs[:-1])
        for c in res["choices"]:
            mine = [e for e in evs if e["choice"] == c["index"]]
            assert "".join(e["text"] for e in mine) == c["text"]
            assert [t for e in mine for t in e["token_ids"]] == c["token_ids"]
