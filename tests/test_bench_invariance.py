"""`tokenmill bench --workload invariance` (tools/bench_invariance.py) at a small size: every job's Result
is the same bits alone and in every placement (mixes, chunked prefill, cache hits, preemption, two
threads, async scheduling), every kind of job is there, the placements do what they say, and the
comparison catches one flipped bit; without batch_invariant the same jobs differ."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenmill.engine.model_config import load_model_config
from tokenmill.engine.types import FinishReason, RequestDelta, TokenLogprob
from tokenmill.tools import bench_invariance as bi


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return tiny_llama_dir, load_model_config(tiny_llama_dir)


@pytest.mark.slow
def test_every_job_is_the_same_bits_in_every_placement(model):
    model_dir, mc = model
    report = bi.run_invariance("tiny-llama", model_dir, mc, num_requests=30, seed=3,
                               engine_options={"cpu_threads": 1}, cost_rounds=0)
    assert report["batch_invariant"] is True
    assert all(report["kinds"][k] > 0 for k in bi.KINDS), report["kinds"]
    assert report["identical"] == 30 and report["share_identical"] == 1.0, report["differing"]
    by_name = {p["name"]: p for p in report["placements"]}
    assert set(by_name) == {p.name for p in bi.PLACEMENTS}
    assert by_name["alone"]["cached_prompt_tokens"] == 0 and by_name["alone"]["threads"] == 1
    assert by_name["mix64-chunked"]["cached_prompt_tokens"] > 0  # shared prefixes served from the cache
    assert by_name["mix64-chunked"]["max_num_batched_tokens"] == 96
    assert by_name["mix64-2threads-async"]["threads"] == 2
    for name in ("mix256-preempt-2threads", "mix256-preempt-async"):
        assert by_name[name]["preemptions"] > 0, name
    assert "throughput_cost" not in report
    table = bi.format_invariance_table(report)
    assert "identical in every placement  30/30" in table


@pytest.mark.slow
def test_without_batch_invariance_the_same_jobs_differ(model):
    """The comparison has teeth: on MKL's GEMMs and torch's SiLU the logprobs move with the batch."""
    model_dir, mc = model
    jobs = [j for j in bi.invariance_jobs(mc.vocab_size, 24, 1, set(mc.eos_token_ids)) if j.kind != "structured"]
    base = {"batch_invariant": "off"}
    alone, facts = bi.run_placement(model_dir, mc, jobs, bi.PLACEMENTS[0], base, 1)
    assert facts["batch_invariant"] is False
    mixed, _ = bi.run_placement(model_dir, mc, jobs, replace(bi.PLACEMENTS[2], mix=len(jobs)), base, 1)
    assert any(bi.differing_field(alone[k], mixed[k]) is not None for k in alone)


def test_one_flipped_bit_of_a_logprob_is_a_difference():
    def delta(logprob: float) -> RequestDelta:
        lp = TokenLogprob(token_id=5, token="a", logprob=logprob, top_logprobs=[(5, "a", logprob)])
        return RequestDelta("r", [5], "a", finished=True, finish_reason=FinishReason.LENGTH, output_token_ids=[5],
                            output_text="a", output_logprobs=[lp])

    a = bi.fingerprint(delta(-1.25))
    assert bi.differing_field(a, bi.fingerprint(delta(-1.25))) is None
    assert bi.differing_field(a, bi.fingerprint(delta(float.fromhex("-0x1.4000000000001p+0")))) == "logprobs"


def test_the_cost_runs_mixed_with_the_setting_on_and_off(model):
    model_dir, mc = model
    cost = bi.throughput_cost(model_dir, mc, {"cpu_threads": 1}, rounds=1, num_requests=6, seed=0)
    assert set(cost["cost_runs_tok_s"]) == {"on", "off"} and all(len(v) == 1 for v in cost["cost_runs_tok_s"].values())
    assert cost["invariant_output_tok_s"] > 0 and cost["plain_output_tok_s"] > 0
    assert cost["throughput_cost"] == pytest.approx(1 - cost["invariant_output_tok_s"] / cost["plain_output_tok_s"],
                                                    abs=2e-3)
