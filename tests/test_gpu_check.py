"""tools/gpu_check (the package): the --dry-run takes the GPU code path on the CPU at toy sizes and writes its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.tools import gpu_check
from tokenmill.tools.gpu_check import runner

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One full dry run in a fresh interpreter (so sys.modules shows exactly what gpu_check imports),
    shared by the tests that read its report: (the process, its output folder)."""
    tmp_path = tmp_path_factory.mktemp("gpu_check_dry_run")
    driver = (
        # The GPU image has the engine's packages only. accelerate (which lm-eval's extra brings into
        # the dev environment) would be imported by transformers' model loading, and it imports
        # boto3 whenever boto3 is installed: hide it, as on the GPU image.
        "import sys; sys.modules['accelerate'] = None\n"
        "import tools.gpu_check as g\n"
        f"rc = g.main(['--dry-run', '--out', {str(tmp_path)!r}])\n"
        "bad = [m for m in ('aiokafka', 'kafka', 'pydantic', 'boto3', 'botocore', 'schemas') if m in sys.modules]\n"
        "print('FORBIDDEN', bad)\n"
        "sys.exit(rc or (3 if bad else 0))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc, tmp_path


@pytest.mark.slow
def test_dry_run_writes_a_complete_report_without_kafka_pydantic_or_boto3(dry_run):
    proc, tmp_path = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["failed"] == []
    sections = report["sections"]
    assert list(sections) == [name for name, _ in gpu_check.SECTIONS]
    assert sections["kernels"]["passed"] >= 8 and sections["kernels"]["failed"] == 0
    assert sections["copy_bandwidth"]["bytes_per_s"] > 0
    fid = sections["fidelity"]
    # On the CPU the GPU path (eager graphs + async scheduling), the plain engine and transformers agree
    # exactly; the graph path was really taken.
    for key in ("gpu_path_vs_transformers", "plain_vs_transformers", "gpu_path_vs_plain"):
        assert fid[key]["equal"] == fid[key]["of"] == 3, (key, fid[key])
    assert fid["cuda_graphs"] == "eager" and fid["async_scheduling"] is True and fid["graph_steps"] > 0
    assert all(r["fraction_of_copy"] > 0 for r in sections["attention"]["runs"])
    inv = sections["invariance"]  # compared, not required under the interpreter (its dot is numpy's BLAS)
    assert inv["invariant_compared"] == inv["default_compared"] > 0 and inv["required"] is False
    assert [r["batch"] for r in sections["decode_step"]["runs"]] == [2, 4]
    assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["graph_step_ms"] > 0
               for r in sections["decode_step"]["runs"])
    mixed = sections["mixed"]
    assert mixed["engine_output_tok_s"] > 0 and mixed["baseline_output_tok_s"] > 0 and mixed["baseline_batch"] in (2, 4)
    thr = sections["throughput"]
    assert thr["sequences"] == 4 and thr["output_tokens"] > 0 and 0 < thr["fraction_of_ceiling"] < 1
    st = sections["structured"]
    assert st["requests"] == 8 and st["peak_running"] == 8 and st["compiles"] == 8 and st["mask_steps"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| throughput | yes |" in md and "## kernels" in md


@pytest.mark.slow
def test_structured_section_measures_constrained_rows_against_the_same_rows_unconstrained(dry_run):
    proc, tmp_path = dry_run
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    st = report["sections"]["structured"]
    assert proc.returncode == 0 and st["ok"], st.get("error", st.get("problems"))
    assert st["requests"] == 8 and st["peak_running"] == 8 and st["compiles"] == 8
    assert st["valid"] == st["stop"] and st["whitespace_runs"] == 0 and st["constraint_failures"] == 0
    assert st["mask_steps"] > 0 and st["step_ms_constrained"] > 0 and st["step_ms_unconstrained"] > 0
    assert st["cuda_graphs"] == "eager" and st["async_scheduling"] is True
    assert "| structured | yes |" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_section_does_not_lose_the_others(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")

    def failed_checks(ctx):  # a section may also report failure without raising (e.g. kernel checks)
        return {"ok": False, "passed": 3, "failed": 1}

    monkeypatch.setattr(runner, "SECTIONS", [("environment", gpu_check.section_environment),
                                             ("attention", broken),
                                             ("kernels", failed_checks),
                                             ("copy_bandwidth", gpu_check.section_copy_bandwidth)])
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    assert rc == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == ["attention", "kernels"]
    assert "boom" in report["sections"]["attention"]["error"]
    assert report["sections"]["copy_bandwidth"]["ok"] and report["sections"]["environment"]["ok"]
    assert "## attention failed" in (tmp_path / "gpu_check.md").read_text()


def test_sections_past_the_budget_are_reported_as_skipped(tmp_path):
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "environment", "copy_bandwidth",
                         "--budget-s", "0"])
    assert rc == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(s.get("skipped") for s in report["sections"].values())


def test_roofline_ceiling_counts_weights_and_growing_context():
    # Two sequences, both running at once: step 1 reads W + (10 + 20) tokens, step 2 W + (11 + 21),
    # step 3 only the second: W + 22.
    out = gpu_check.roofline_ceiling([10, 20], [2, 3], weight_bytes=1000, kv_bytes_per_token=10, copy_bw=1e6,
                                     max_num_seqs=8)
    assert out["steps"] == 3
    assert out["bytes"] == 3 * 1000 + 10 * (30 + 32 + 22)
    assert out["tokens_per_s"] == pytest.approx(5 / (out["bytes"] / 1e6))
    # One at a time: 2 + 3 steps.
    assert gpu_check.roofline_ceiling([10, 20], [2, 3], 1000, 10, 1e6, max_num_seqs=1)["steps"] == 5


def test_llama_param_count_matches_transformers():
    import transformers

    shape = dict(gpu_check.TOY_LLAMA)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    assert gpu_check.llama_param_count(shape) == sum(p.numel() for p in model.parameters())


def test_wrapper_script_help_is_quick_and_clean():
    proc = subprocess.run([str(ROOT / "tools" / "gpu_check" / "run"), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout
