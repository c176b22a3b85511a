"""`bench --workload score` at a small size (test-llama, 3 questions of short contexts): the report's
fields, the prefix cache computing each context once (prefill tokens computed below what no cache
would compute), the engine's loglikelihoods agreeing with transformers', the agreement check
failing loudly on a corrupted value, and the memory figure's child runs."""

from __future__ import annotations

import json

import pytest

from tokenmill.engine.model_config import load_model_config
from tokenmill.tools.bench import run_bench
from tokenmill.tools.bench_score import (
    CHOICES,
    LoglikelihoodMismatch,
    check_agreement,
    score_workload,
)
from tokenmill.tools.tiny_models import cached_tiny_model

BLOCK = 16  # the engine's default block size
SHAPE = {"context_len": (40, 56), "continuation_len": (3, 6)}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    model_dir = cached_tiny_model("test-llama")
    return run_bench("score", str(model_dir), num_requests=12, engine_options={"dtype": "float32"},
                     workload_options={**SHAPE, "memory_tokens": 200})


def test_the_workload_shares_one_context_per_question():
    work = score_workload(2048, num_questions=5, seed=1, special={0, 1, 2}, **SHAPE)
    assert work.num_requests == 5 * CHOICES and len(work.prompts) == 20
    for q, ctx in enumerate(work.contexts):
        assert 40 <= len(ctx) <= 56
        for c, cont in enumerate(work.choices[q]):
            assert 3 <= len(cont) <= 6
            assert work.prompts[q * CHOICES + c] == ctx + cont
            assert work.score_from[q * CHOICES + c] == len(ctx)
    assert all(3 <= t < 2048 for p in work.prompts for t in p)  # no special id
    assert score_workload(2048, 5, 1, {0, 1, 2}, **SHAPE).prompts == work.prompts  # seeded
    assert score_workload(2048, 5, 2, {0, 1, 2}, **SHAPE).prompts != work.prompts


@pytest.mark.slow
def test_the_report_has_the_figures_and_the_cache_computes_each_context_once(report):
    for key in ("ratio", "prefill_tokens_computed", "prompt_tokens", "prefill_fraction", "peak_rss_mb",
                "engine_requests_s", "engine_tok_s", "baseline_requests_s", "baseline_tok_s",
                "baseline_batch_size", "loglikelihood_max_abs_diff", "peak_rss_mb_scored",
                "peak_rss_mb_plain", "memory_ratio", "peak_rss_mb_loaded"):
        assert key in report, key
    json.dumps(report)  # --json writes it as it is
    assert report["workload"] == "score" and report["requests"] == 12 and report["questions"] == 3
    assert report["baseline_batch_size"] in (8, 32)
    assert report["ratio"] > 0 and report["peak_rss_mb"] > 0
    assert report["loglikelihood_max_abs_diff"] <= 1e-3
    mc = load_model_config(cached_tiny_model("test-llama"))
    work = score_workload(mc.vocab_size, 3, 0, set(mc.eos_token_ids), **SHAPE)  # what the bench ran
    assert report["prompt_tokens"] == work.prompt_tokens
    # Without the cache every prompt token is computed; with it, the three later choices of a
    # question read the context's full blocks before score_from - 1 from the cache.
    no_cache = work.prompt_tokens
    reuse = sum(3 * ((len(ctx) - 1) // BLOCK * BLOCK) for ctx in work.contexts)
    assert report["prefill_tokens_computed"] == no_cache - reuse < no_cache
    assert report["prefill_fraction"] == pytest.approx(report["prefill_tokens_computed"] / no_cache)
    assert report["cached_prompt_tokens"] == reuse


def test_the_memory_figure_runs_each_side_in_its_own_process(report):
    assert report["memory_prompt_tokens"] == 200
    assert report["peak_rss_mb_scored"] >= report["peak_rss_mb_loaded"] > 0
    assert report["peak_rss_mb_plain"] >= report["peak_rss_mb_loaded"]
    assert report["memory_ratio"] == pytest.approx(report["peak_rss_mb_scored"] / report["peak_rss_mb_plain"])


def test_the_agreement_check_fires_on_a_corrupted_loglikelihood():
    sums = [-10.5, -22.25, -7.0]
    assert check_agreement(sums, [s + 1e-5 for s in sums]) == pytest.approx(1e-5, abs=1e-9)
    corrupted = list(sums)
    corrupted[1] += 0.01
    with pytest.raises(LoglikelihoodMismatch, match=r"1 of 3 loglikelihoods differ by more than 0.001: request 1"):
        check_agreement(sums, corrupted)
    with pytest.raises(LoglikelihoodMismatch, match="differ"):
        check_agreement(sums, [sums[0], float("nan"), sums[2]])
    with pytest.raises(LoglikelihoodMismatch, match="3 engine loglikelihoods against 2"):
        check_agreement(sums, sums[:2])


def test_the_bench_fails_when_the_engine_disagrees_with_transformers(monkeypatch):
    import tokenmill.tools.bench_score as bench_score

    real = bench_score.run_engine_score

    def corrupt(*args, **kwargs):
        run = real(*args, **kwargs)
        run["sums"][2] -= 0.5
        return run

    monkeypatch.setattr(bench_score, "run_engine_score", corrupt)
    with pytest.raises(LoglikelihoodMismatch, match="request 2"):
        run_bench("score", str(cached_tiny_model("test-llama")), num_requests=4,
                  engine_options={"dtype": "float32"}, workload_options={**SHAPE, "memory_tokens": 0})


def test_bad_sizes_are_refused():
    model = str(cached_tiny_model("test-llama"))
    with pytest.raises(ValueError, match="multiple of 4"):
        run_bench("score", model, num_requests=6, workload_options={"memory_tokens": 0})
    with pytest.raises(ValueError, match="needs 3000 positions"):
        run_bench("score", model, num_requests=4,
                  workload_options={"context_len": (2990, 2990), "continuation_len": (10, 10), "memory_tokens": 0})
    with pytest.raises(ValueError, match="workload_options are for the score and invariance workloads"):
        run_bench("prefix", model, num_requests=4, workload_options={"memory_tokens": 0})


def test_the_cli_runs_the_score_workload_and_writes_its_json(tmp_path, capsys):
    from tokenmill.cli import main

    out = tmp_path / "score.json"
    model = str(cached_tiny_model("test-llama"))
    assert main(["bench", "--workload", "score", "--model", model, "--requests", "4", "--memory-tokens", "0",
                 "--dtype", "float32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "score" and report["requests"] == 4 and report["threads"] == 1
    assert report["prefill_tokens_computed"] < report["prompt_tokens"] and "memory_ratio" not in report
    assert "prefill tokens computed / prompt tokens" in capsys.readouterr().out
    # Refused before anything loads, with the bad-usage exit code.
    assert main(["bench", "--workload", "prefix", "--model", model, "--memory-tokens", "10"]) == 2
    assert "--memory-tokens is an option of --workload score" in capsys.readouterr().err


def test_a_model_too_short_for_the_memory_prompt_runs_from_a_copy_that_allows_it(tmp_path, monkeypatch):
    from tokenmill.tools.bench_score import _model_allowing

    source = cached_tiny_model("test-llama")  # 2,048 positions
    assert _model_allowing(source, 2048) == source
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    copy = _model_allowing(source, 4097)
    assert copy != source and copy.parent == tmp_path / "models"
    assert load_model_config(copy).max_model_len == 8192
    assert (copy / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert _model_allowing(source, 4097) == copy  # built once
