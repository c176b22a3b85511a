"""An exception in an engine step fails only the requests that cause it.

Engine level: faults injected into the runner's step inputs, the sampler and one request's
detokenizer, synchronous and overlapped: the culprit ends with ERROR / INTERNAL and the exception,
every other request's greedy tokens equal a run without the fault, and the engine holds nothing
at the end (blocks, runner rows, request maps). Against the real broker: one poisoned job out of
200 gets an `internal` error Result and a dead letter carrying the exception, the other 199 are
ok, and the worker stays up.
"""

import asyncio
import json
import math
import random

import pytest

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import EngineRequest, ErrorKind, FinishReason, SamplingParams

NUM_REQUESTS = 10
MAX_NUM_SEQS = 8
MAX_STEPS = 2000  # a run that takes more steps is looping


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(2, 30))] for _ in range(n)]


PROMPTS = make_prompts(NUM_REQUESTS)
MAX_NEW = [7, 3, 9, 5, 8, 2, 6, 9, 4, 7]


def requests(max_new=MAX_NEW, **sampling) -> list[EngineRequest]:
    return [
        EngineRequest(request_id=f"r{i}", prompt_token_ids=p,
                      sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **sampling))
        for i, (p, n) in enumerate(zip(PROMPTS, max_new, strict=True))
    ]


def engine_for(model_dir, **overrides) -> Engine:
    cfg = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4, max_num_seqs=MAX_NUM_SEQS,
               kv_cache_gb=0.002)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list]:
    """Run to completion; per request, every delta in order."""
    for r in reqs:
        engine.add(r)
    per_request: dict[str, list] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps < MAX_STEPS, "the engine loops"
        for d in engine.step():
            per_request.setdefault(d.request_id, []).append(d)
    return per_request


def assert_holds_nothing(engine: Engine) -> None:
    engine.block_manager.check_invariants()
    assert engine.held_state() == dict.fromkeys(engine.held_state(), 0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def assert_only_culprit_failed(per_request, reference, culprit: str, message: str) -> None:
    assert sorted(per_request) == sorted(reference)
    for rid, deltas in per_request.items():
        final = deltas[-1]
        assert final.finished and not any(d.finished for d in deltas[:-1]), rid
        if rid == culprit:
            assert final.finish_reason is FinishReason.ERROR and final.error_kind is ErrorKind.INTERNAL
            assert message in final.error, final.error
        else:
            assert final.finish_reason is FinishReason.LENGTH, (rid, final.error)
            assert final.output_token_ids == reference[rid], rid
            assert sum((d.new_token_ids for d in deltas), []) == final.output_token_ids, rid  # nothing twice


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {mode: engine_for(tiny_llama_dir, async_scheduling=mode) for mode in ("off", "on")}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, async_scheduling="off")
    return {rid: ds[-1].output_token_ids for rid, ds in run(engine, requests()).items()}


def inject(engine: Engine, monkeypatch, where: str, culprit: str) -> list[int]:
    """Make `where` raise in every step that holds `culprit`; returns the list of batch sizes it
    raised for."""
    raised: list[int] = []
    if where == "inputs":
        original = engine.runner.prepare

        def prepare(reqs, num_new_tokens, pending=None):
            if any(r.request_id == culprit for r in reqs):
                raised.append(len(reqs))
                raise RuntimeError("injected fault in the step inputs")
            return original(reqs, num_new_tokens, pending)

        monkeypatch.setattr(engine.runner, "prepare", prepare)
    else:
        original_sample = engine.sampler.sample_ids

        def sample_ids(logits, inputs, token_mask=None):
            target = engine.requests.get(culprit)
            if target is not None and any(inp is target.sampling_inputs for inp in inputs):
                raised.append(len(inputs))
                raise ValueError("injected fault in sampling")
            return original_sample(logits, inputs, token_mask)

        monkeypatch.setattr(engine.sampler, "sample_ids", sample_ids)
        # Greedy rows would skip the sampler (the greedy screen finds their tokens in the forward).
        monkeypatch.setattr(engine.runner.model, "greedy_ids", lambda hidden, allowed=None, edits_for=None: None)
    return raised


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("where", ["inputs", "sampling"])
def test_a_step_that_raises_for_one_request_fails_only_that_request(engines, reference, monkeypatch, mode, where):
    engine = engines[mode]
    assert engine.async_scheduling is (mode == "on")
    raised = inject(engine, monkeypatch, where, "r2")
    preemptions = engine.metrics.num_preemptions
    recover, recoveries = engine._recover, []

    def checked_recover(fault):
        recover(fault)
        # Consistent at once: nothing runs or is in flight, no block is held, no placeholder left.
        engine.block_manager.check_invariants([r.kv for r in engine.requests.values()])
        assert engine.block_manager.num_used_blocks == 0 and engine.overlap.in_flight is None
        assert not engine.scheduler.running and not any(r.has_pending_token for r in engine.requests.values())
        recoveries.append(fault.phase)

    monkeypatch.setattr(engine, "_recover", checked_recover)
    per_request = run(engine, requests())
    message = "RuntimeError: injected fault in the step inputs" if where == "inputs" else "ValueError: injected"
    assert_only_culprit_failed(per_request, reference, "r2", message)
    # Bisection: the failing batch halves each time, down to the culprit alone, which fails twice
    # at most (its first failure alone may be transient, so it gets one probation).
    assert raised[-1] == 1 and len(raised) <= 2 + math.ceil(math.log2(MAX_NUM_SEQS)), raised
    assert raised == sorted(raised, reverse=True) and len(recoveries) == len(raised)
    assert engine.metrics.num_preemptions > preemptions  # recovery went through preemption
    assert_holds_nothing(engine)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_detokenizer_that_raises_fails_only_its_request(engines, reference, mode):
    engine = engines[mode]
    reqs = requests()
    for r in reqs:
        engine.add(r)
    detok = engine.requests["r4"].detokenizer
    calls = []
    original = detok.add

    def add(token_id, check_stop=True):
        calls.append(token_id)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(token_id, check_stop)

    detok.add = add
    preemptions = engine.metrics.num_preemptions
    per_request = run(engine, [])
    assert_only_culprit_failed(per_request, reference, "r4", "UnicodeDecodeError")
    culprit = per_request["r4"]
    assert [d.new_token_ids for d in culprit[:-1]] == [[t] for t in reference["r4"][:2]]  # its 2 good tokens
    assert engine.metrics.num_preemptions == preemptions  # a row failure needs no recovery
    assert_holds_nothing(engine)


def test_a_fault_that_returns_after_probation_is_pinned_down_without_failing_others(engines, monkeypatch):
    """A fault that strikes when the culprit decodes after its 3rd, 6th, 9th... token passes every
    short probation (a recompute is a prefill): rounds repeat until the culprit is a repeat
    suspect, whose probation lasts until it finishes; then it fails alone and nobody else fails."""
    engine = engines["off"]
    original = engine.runner.prepare
    raised = []

    def prepare(reqs, num_new_tokens, pending=None):
        for r in reqs:
            n_out = len(r.output_token_ids)
            # A row held since an earlier step (a recompute after preemption has none yet).
            if r.request_id == "r7" and r.runner_row >= 0 and n_out and n_out % 3 == 0:
                raised.append(n_out)
                raise RuntimeError("injected fault at every third token")
        return original(reqs, num_new_tokens, pending)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    max_new = [12] * NUM_REQUESTS
    max_new[7] = 24
    per_request = run(engine, requests(max_new))
    failed = {rid for rid, ds in per_request.items() if ds[-1].finish_reason is not FinishReason.LENGTH}
    assert failed == {"r7"}
    assert per_request["r7"][-1].error_kind is ErrorKind.INTERNAL
    for rid, deltas in per_request.items():
        final = deltas[-1]
        assert sum((d.new_token_ids for d in deltas), []) == final.output_token_ids, rid
        assert rid == "r7" or len(final.output_token_ids) == 12, rid
    assert raised[:3] == [3, 6, 9]  # it came back after probation, round after round
    assert_holds_nothing(engine)


def test_a_fault_with_no_request_to_blame_still_raises(engines, monkeypatch):
    engine = engines["off"]
    for r in requests()[:3]:
        engine.add(r)

    def schedule():
        raise RuntimeError("injected scheduler bug")

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    with pytest.raises(RuntimeError, match="injected scheduler bug"):
        engine.step()
    monkeypatch.undo()
    run(engine, [])
    assert_holds_nothing(engine)


def test_an_engine_whose_every_step_fails_stops_instead_of_failing_request_after_request(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    original = engine.runner.prepare

    def prepare(reqs, num_new_tokens, pending=None):
        raise RuntimeError("injected: the device is gone")

    engine.runner.prepare = prepare
    for r in requests():
        engine.add(r)
    failed, steps = [], 0
    with pytest.raises(RuntimeError, match="the device is gone"):
        while engine.has_work():
            steps += 1
            failed += [d.request_id for d in engine.step() if d.finished]
    limit = engine.faults.max_failures_in_a_row
    # Requests were found "alone at fault" on the way, but no step ran since: none was failed.
    assert steps == limit + 1 and failed == [] and engine.held_state()["failures_held"] > 0
    engine.runner.prepare = original


def test_an_idle_engine_holds_no_finished_request(engines):
    engine = engines["on"]
    finals = run(engine, requests())
    assert len(finals) == NUM_REQUESTS
    # No extra step: the step that ended the last request already freed its rows and blocks.
    assert_holds_nothing(engine)
    assert not engine.scheduler._finished


# ---------------------------------------------------------------------------------------- worker
POISON_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.mark.kafka
async def test_an_engine_exception_in_one_job_of_200_fails_only_that_job(kafka_bootstrap, tiny_llama_dir):
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

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=64, max_num_batched_tokens=1024,
                                 kv_cache_gb=0.05))
    original = engine.runner.prepare

    def prepare(reqs, num_new_tokens, pending=None):
        if any(r.prompt_token_ids == POISON_PROMPT for r in reqs):
            raise RuntimeError("injected engine fault for the poisoned job")
        return original(reqs, num_new_tokens, pending)

    engine.runner.prepare = prepare
    topics = await make_topics(kafka_bootstrap, "faults", partitions=2)
    jobs = [job(i, ("prompt", "tokens")[i % 2], stream=(i % 5 == 0), max_tokens=3 + i % 4) for i in range(200)]
    poisoned = jobs[137]
    poisoned.pop("prompt", None)
    poisoned["prompt_token_ids"] = POISON_PROMPT
    await produce(kafka_bootstrap, topics.jobs, jobs)
    settings = worker_settings(kafka_bootstrap, topics, tiny_llama_dir, metrics_port=0)
    async with running_worker(settings, engine) as (w, task):
        records = await read_topic(kafka_bootstrap, topics.results, count_unique_jobs(200), timeout=120)
        dead = await read_topic(kafka_bootstrap, topics.dlq, lambda r: len(r) >= 1, timeout=30)
        await asyncio.sleep(0.5)
        assert not task.done() and w.engine_thread.alive and w.fatal_error is None  # the worker is up
        assert w.health.healthy()[0]
        assert engine.held_state() == dict.fromkeys(engine.held_state(), 0)
        engine.block_manager.check_invariants()
    assert task.result() == 0
    results = results_by_job(records)
    assert len(results) == 200 and all(len(v) == 1 for v in results.values())
    bad = results.pop(poisoned["job_id"])[0]
    assert bad["status"] == "error" and bad["error"]["code"] == "internal"
    assert "RuntimeError: injected engine fault for the poisoned job" in bad["error"]["message"]
    assert all(v[0]["status"] == "ok" for v in results.values())
    (letter,) = dead
    headers = {k: v.decode() for k, v in letter.headers}
    assert headers["tokenmill.error.code"] == "internal"
    assert "RuntimeError: injected engine fault" in headers["tokenmill.error.message"]
    assert json.loads(letter.value)["job_id"] == poisoned["job_id"]
    assert await committed_offsets(kafka_bootstrap, topics.group, topics.jobs, 2) == await end_offsets(
        kafka_bootstrap, topics.jobs, 2)


def test_blame_wraps_an_error_once_and_lets_the_rest_through():
    from tokenmill.engine.fault_isolation import StepFault, blame

    suspects = ["a", "b"]
    with pytest.raises(StepFault) as caught:
        with blame("launch", suspects):
            raise ValueError("bad row")
    fault = caught.value
    assert fault.phase == "launch" and fault.suspects == suspects and isinstance(fault.error, ValueError)
    assert fault.__cause__ is fault.error and str(fault) == "launch: ValueError: bad row"
    with pytest.raises(StepFault) as again:  # already blamed: not wrapped a second time
        with blame("step end", ["c"]):
            raise fault
    assert again.value is fault
    with pytest.raises(KeyboardInterrupt):  # not an error of a request
        with blame("take-in", suspects):
            raise KeyboardInterrupt
    with blame("take-in", suspects):
        pass
