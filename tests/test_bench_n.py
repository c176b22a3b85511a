"""`bench --workload n` at a small size: the n run computes each prompt once, every choice equals
the single job with its seed, and a second run gives the same samples."""

import pytest

from tokenmill.tools.bench import format_table, run_bench
from tokenmill.tools.tiny_models import cached_tiny_model

pytestmark = pytest.mark.usefixtures("fresh_startup_clock")


def test_n_workload_report():
    model = str(cached_tiny_model("test-llama"))
    report = run_bench("n", model, num_requests=3, engine_options={"dtype": "float32"})
    assert report["workload"] == "n" and report["n"] == 8 and report["requests"] == 24
    assert report["prefill_tokens_computed"] == report["prompt_tokens"]  # one prefill per prompt
    assert report["baseline_prefill_tokens_computed"] > report["prompt_tokens"]  # singles recompute last blocks
    assert report["identical_to_singles"] is True and report["identical_across_runs"] is True
    assert report["output_tokens"] == 24 * 32 and report["ratio"] > 0 and report["peak_rss_mb"] > 0
    assert report["startup_s"] > 0 and report["first_result_s"] > 0
    table = format_table(report)
    assert "prefill tokens computed (n)" in table and "identical to single seeded jobs" in table
    assert "s  (process start -> engine ready)" in table
