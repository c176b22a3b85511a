"""`tokenmill bench`: a tiny run of each workload writes a JSON report with the agreed fields."""

import json

import pytest

from worker.cli import main

FIELDS = {
    "workload", "model", "engine_output_tok_s", "baseline_output_tok_s", "ratio", "kv_slot_utilization_peak",
    "engine_overhead_fraction", "prompt_tokens", "prefill_tokens_computed", "cached_prompt_tokens",
}


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
    assert "ratio" in capsys.readouterr().out


@pytest.mark.kafka
def test_bench_kafka_workload_is_reachable_from_the_cli(tmp_path, tiny_llama_dir, kafka_bootstrap):
    out = tmp_path / "kafka.json"
    code = main(["bench", "--workload", "kafka", "--model", str(tiny_llama_dir), "--requests", "2",
                 "--kv-cache-gb", "0.05", "--bootstrap-servers", kafka_bootstrap, "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "kafka" and report["requests"] == 2 and report["ratio"] > 0
