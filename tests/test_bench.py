"""`tokenmill bench`: a tiny run of each workload writes a JSON report with the agreed fields."""

import json
import os
import subprocess
import sys
import time

import pytest

from tokenmill.cli import main

FIELDS = {
    "workload", "model", "engine_output_tok_s", "baseline_output_tok_s", "ratio", "kv_slot_utilization_peak",
    "engine_overhead_fraction", "prompt_tokens", "prefill_tokens_computed", "cached_prompt_tokens",
    "startup_s", "first_result_s",
}

pytestmark = pytest.mark.usefixtures("fresh_startup_clock")


@pytest.mark.slow
@pytest.mark.parametrize("workload,requests", [("mixed", 3), ("prefix", 6)])
def test_bench_writes_report(tmp_path, tiny_llama_dir, workload, requests, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--workload", workload, "--model", str(tiny_llama_dir), "--requests", str(requests),
                 "--kv-cache-gb", "0.05", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert FIELDS <= set(report)
    assert report["workload"] == workload and report["requests"] == requests
    assert report["engine_output_tok_s"] > 0 and report["baseline_output_tok_s"] > 0
    assert report["ratio"] == pytest.approx(report["engine_output_tok_s"] / report["baseline_output_tok_s"])
    assert 0 < report["kv_slot_utilization_peak"] <= 1
    assert 0 <= report["engine_overhead_fraction"] < 1
    if workload == "mixed":
        assert report["prefill_tokens_computed"] == report["prompt_tokens"]
        assert report["baseline_batch_size"] in (8, 32, 64)
        assert report["output_tokens"] >= 16 * requests
    else:
        assert report["prompt_tokens"] == requests * 544
        # One request computes the shared 512-token prefix; the others only their own 32 tokens.
        assert report["cached_prompt_tokens"] == (requests - 1) * 512
        assert report["prefill_tokens_computed"] == report["prompt_tokens"] - report["cached_prompt_tokens"]
        assert report["baseline_prefill_tokens_computed"] == report["prompt_tokens"]
    assert report["startup_s"] > 0 and report["first_result_s"] > 0
    table = capsys.readouterr().out
    assert "ratio" in table and "s  (process start -> engine ready)" in table


@pytest.mark.slow
def test_a_bench_process_reports_its_start_and_its_first_result(tmp_path, tiny_llama_dir):
    """From the process's own start to its first engine ready, then to that engine's first
    finished request: both inside the process's wall time, one after the other."""
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "--workload", "prefix", "--model",
                           str(tiny_llama_dir), "--requests", "2", "--kv-cache-gb", "0.05", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert 0 < report["startup_s"] and 0 < report["first_result_s"]
    assert report["startup_s"] + report["first_result_s"] < wall
    # The CPU it took: the interpreter and torch's import at least, and within what the cores give.
    assert 0.1 < report["startup_cpu_s"] < (os.cpu_count() or 1) * report["startup_s"] + 0.5
    assert f"{report['startup_cpu_s']:.2f} s  (the process's CPU time" in done.stdout
    assert f"{report['startup_s']:.2f} s" in done.stdout and f"{report['first_result_s']:.2f} s" in done.stdout


STRUCTURED_FIELDS = {
    "step_overhead_fraction", "mask_ms_p50", "mask_ms_p99", "compile_ms_p50", "compile_ms_p99", "valid_fraction",
    "whitespace_runs", "stop", "length", "constrained_output_tok_s", "unconstrained_output_tok_s",
}


def test_bench_structured_constrains_every_row_and_compares_it_with_the_same_rows_unconstrained(
        tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "structured.json"
    code = main(["bench", "--workload", "structured", "--model", str(tiny_llama_dir), "--requests", "8",
                 "--repeats", "2", "--kv-cache-gb", "0.05", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert STRUCTURED_FIELDS <= set(report)
    assert report["workload"] == "structured" and report["requests"] == 8 and report["peak_running"] == 8
    # One compile per schema (8 requests, one of each; the second constrained pass finds them all in
    # the compile cache), every constraint compiled, every row masked; greedy repeats give equal tokens.
    assert report["repeats"] == 2 and report["repeat_outputs_equal"] is True
    assert len(report["step_overhead_fraction_pairs"]) == 2
    assert report["compiles"] == 8 and report["constraint_failures"] == 0 and report["other_finish"] == 0
    assert report["mask_steps"] > 0 and 0 < report["mask_ms_p50"] <= report["mask_ms_p99"]
    assert 0 < report["compile_ms_p50"] <= report["compile_ms_p99"]
    # Every output that reached the end of its grammar parses and validates, none is padded.
    assert report["stop"] + report["length"] == 8 and report["stop"] >= 1
    assert report["valid"] == report["stop"] and report["valid_fraction"] == 1.0
    assert report["whitespace_runs"] == 0 and report["problems"] == []
    assert report["step_ms_constrained"] > 0 and report["step_ms_unconstrained"] > 0
    assert report["step_overhead_fraction"] == pytest.approx(
        report["step_ms_constrained"] / report["step_ms_unconstrained"] - 1)
    assert report["peak_decode_steps_constrained"] >= 1 and report["peak_decode_steps_unconstrained"] >= 1
    assert report["startup_s"] > 0 and report["first_result_s"] > 0
    table = capsys.readouterr().out
    assert "step overhead at peak" in table and "s  (engine ready -> first request done)" in table


@pytest.mark.kafka
def test_bench_kafka_workload_is_reachable_from_the_cli(tmp_path, tiny_llama_dir, kafka_bootstrap):
    out = tmp_path / "kafka.json"
    code = main(["bench", "--workload", "kafka", "--model", str(tiny_llama_dir), "--requests", "2",
                 "--kv-cache-gb", "0.05", "--bootstrap-servers", kafka_bootstrap, "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "kafka" and report["requests"] == 2 and report["ratio"] > 0
    assert report["startup_s"] > 0 and report["first_result_s"] > 0


def test_mapping_the_kv_cache_keeps_every_value_written_and_the_next_requests_answer_the_same(tiny_llama_dir):
    """map_kv_cache writes every page of the cache (x 1.0) before the lockstep benches time anything:
    the values already in it keep their bits (a cached prefix still serves), and an engine that was
    mapped answers as one that was not."""
    import torch

    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.engine.types import EngineRequest, SamplingParams
    from tokenmill.tools.bench_startup import map_kv_cache

    def requests(tag):
        return [EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=[(3 * i + j) % 500 + 5 for j in range(20)],
                              sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2))
                for i in range(4)]

    engines = [Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.02)) for _ in range(2)]
    for e in engines:
        e.generate(requests("warm"))
    before = [(k.clone(), v.clone()) for k, v in engines[0].runner.kv_caches]
    map_kv_cache(engines[0])
    for (k0, v0), (k1, v1) in zip(before, engines[0].runner.kv_caches, strict=True):
        for a, b in ((k0, k1), (v0, v1)):
            kept = ~torch.isnan(a)  # (never-written slots may hold any bits; a NaN among them may be quieted)
            assert torch.equal(a.view(torch.int32)[kept], b.view(torch.int32)[kept])
    mapped, plain = (e.generate(requests("warm")) for e in engines)  # prefix-cache hits on the kept blocks
    assert engines[0].stats().cached_prompt_tokens_total > 0
    for rid, d in plain.items():
        assert mapped[rid].output_token_ids == d.output_token_ids
        assert [lp.logprob for lp in mapped[rid].logprobs] == [lp.logprob for lp in d.logprobs]
    map_kv_cache(object())  # an engine without a KV cache of ours (another backend): nothing to do
