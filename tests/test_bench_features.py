"""`bench --workload features` at a small size: every feature's passes ran against plain greedy rows
doing the same decode work, and the report names each feature's step overhead (computed from its
step times), which features are held to the goal, the CPU's instruction sets and the engine's paths."""

import json

import pytest

from tokenmill.cli import main
from tokenmill.tools.bench_features import FEATURE_NAMES, GOAL, STATED, cpu_features

STEP_FIELDS = {
    "step_overhead_fraction", "step_ms", "plain_step_ms", "step_overhead_fraction_median",
    "step_overhead_fraction_by_cpu_time", "step_model_ms", "plain_step_model_ms", "pass_overhead_fraction",
    "peak_running", "peak_decode_steps", "plain_peak_decode_steps", "output_tokens", "requests", "within_goal",
}


@pytest.mark.slow
def test_bench_features_compares_each_feature_with_plain_greedy_rows(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "features.json"
    code = main(["bench", "--workload", "features", "--model", str(tiny_llama_dir), "--requests", "8",
                 "--repeats", "1", "--kv-cache-gb", "0.05", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "features" and report["requests"] == 8 and report["repeats"] == 1
    assert set(report["features"]) == set(FEATURE_NAMES) == {
        "structured", "logprobs", "top_p", "penalties", "stop", "n", "prompt_logprobs"}
    assert report["goal"] == GOAL and set(report["stated"]) == set(STATED) == {"n", "prompt_logprobs"}
    for name, f in report["features"].items():
        assert STEP_FIELDS <= set(f), name
        assert f["step_ms"] > 0 and f["plain_step_ms"] > 0
        assert f["step_overhead_fraction"] == pytest.approx(f["step_ms"] / f["plain_step_ms"] - 1)
        assert f["pass_overhead_fraction"] == pytest.approx(f["pass_wall_s"] / f["plain_pass_wall_s"] - 1)
        assert f["peak_decode_steps"] >= 1 and f["plain_peak_decode_steps"] >= 1
        if name in STATED:
            assert f["within_goal"] is None
        else:
            assert f["within_goal"] is (f["step_overhead_fraction"] <= GOAL)
    # n: a quarter of the prompts, four choices each, against as many plain rows.
    assert report["features"]["n"]["requests"] == 2 and report["features"]["n"]["peak_running"] == 8
    assert report["features"]["logprobs"]["output_tokens"] == report["features"]["top_p"]["output_tokens"]
    assert report["all_within_goal"] is all(f["within_goal"] is not False for f in report["features"].values())
    for key in ("avx2", "avx512", "avx512_bf16", "amx"):
        assert report[key] is cpu_features()[key]
    assert report["cpu"] and {"greedy_screen", "amx_gemm", "onednn_linear"} <= set(report["cpu_paths"])
    # Where plain rows take the greedy screen, logprobs and top_p (which need the whole float32 head)
    # are also set against plain rows on an engine without it; nowhere else.
    screen = report["cpu_paths"]["greedy_screen"]
    for name, f in report["features"].items():
        if screen and name in ("logprobs", "top_p"):
            assert f["step_overhead_over_full_head"] == pytest.approx(f["step_ms"] / f["full_head_step_ms"] - 1)
            assert f["full_head_fraction"] == pytest.approx(f["full_head_step_ms"] / f["plain_step_ms"] - 1)
        else:
            assert "step_overhead_over_full_head" not in f and "full_head_fraction" not in f, name
    table = capsys.readouterr().out
    assert ("over plain rows on the whole float32 LM head" in table) is bool(screen)
    assert all(name in table for name in FEATURE_NAMES) and "AVX-512" in table and "AMX" in table
