"""`tokenmill eval` on a local engine: the results table and JSON, equal to lm-eval driven in-process,
and the command line's refusals (unknown task, bad --limit, no lm-eval, flags of the other mode)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.models import cache_with_built_kernels
from tokenmill.cli import main as tokenmill

TASKS = "tokenmill_mc,tokenmill_gen,tokenmill_ppl"
LIMIT = 3
BOOTSTRAP = 50


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """Every task's numeric metrics (acc, acc_norm, exact_match, perplexities, their stderrs)."""
    return {
        task: {k: v for k, v in values.items() if "," in k and isinstance(v, (int, float))}
        for task, values in results["results"].items()
    }


def in_process_metrics(model_dir) -> dict[str, dict[str, float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tokenmill.eval import TASKS_DIR
    from tokenmill.eval.lm import TokenmillLM
    from tokenmill.eval.local_runner import LocalJobRunner

    runner = LocalJobRunner(model_dir)
    try:
        lm = TokenmillLM(runner.tokenizer, runner, model_name=runner.model_name, max_length=runner.max_length)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=TASKS.split(","), limit=LIMIT, bootstrap_iters=BOOTSTRAP, log_samples=False,
            task_manager=TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False),
        )
    finally:
        runner.close()
    return metrics(results)


def test_eval_prints_and_writes_the_metrics_lm_eval_gives_in_process(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "res" / "results.json"
    code = tokenmill(["eval", "--model", str(tiny_llama_dir), "--tasks", TASKS, "--limit", str(LIMIT),
                      "--bootstrap-iters", str(BOOTSTRAP), "--output", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    written = json.loads(out.read_text())
    got = metrics(written)
    assert set(got) == set(TASKS.split(","))
    assert {"acc,none", "acc_norm,none"} <= set(got["tokenmill_mc"])
    assert "exact_match,none" in got["tokenmill_gen"]
    assert got["tokenmill_ppl"]["word_perplexity,none"] > 1
    assert all(written["results"][t]["sample_len"] == LIMIT for t in got)
    for task in got:  # the table names every task and its metrics
        assert task in printed
    for metric in ("acc_norm", "exact_match", "word_perplexity", "bits_per_byte"):
        assert metric in printed
    assert f"{got['tokenmill_ppl']['bits_per_byte,none']:.4f}" in printed

    expected = in_process_metrics(tiny_llama_dir)
    assert got.keys() == expected.keys()
    for task in got:
        assert got[task] == pytest.approx(expected[task], rel=1e-9, abs=1e-12), task


def test_an_s3_model_is_downloaded_into_the_cache_and_evaluated(tiny_llama_dir, s3_bucket, tmp_path, monkeypatch,
                                                                  capsys):
    import boto3

    client = boto3.client("s3")
    for f in tiny_llama_dir.iterdir():
        if f.is_file():
            client.upload_file(str(f), s3_bucket, f"models/tiny-llama/{f.name}")
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache_with_built_kernels(tmp_path / "cache")))
    out = tmp_path / "results.json"
    code = tokenmill(["eval", "--model", f"s3://{s3_bucket}/models/tiny-llama/", "--tasks", "tokenmill_mc",
                      "--limit", "1", "--output", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert list((tmp_path / "cache").rglob("config.json"))
    written = json.loads(out.read_text())
    assert written["results"]["tokenmill_mc"]["sample_len"] == 1
    assert written["config"]["model_name"] == "tiny-llama"  # named as a worker names an s3:// model


def _fail(capsys, argv: list[str]) -> str:
    code = tokenmill(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_an_unknown_task_is_refused_naming_the_shipped_ones(tiny_llama_dir, capsys, monkeypatch):
    import lm_eval.tasks

    real = lm_eval.tasks.TaskManager
    # lm-eval's own thousands of tasks take long to index: leave them out of this test.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        lambda include_path=None, **_: real(include_path=include_path, include_defaults=False))
    err = _fail(capsys, ["eval", "--model", str(tiny_llama_dir), "--tasks", "tokenmill_mc,no_such_task"])
    assert "unknown task(s): no_such_task" in err
    assert "tokenmill_gen, tokenmill_mc, tokenmill_ppl" in err


@pytest.mark.parametrize("limit", ["0", "-3", "1.5", "ten"])
def test_a_bad_limit_is_refused(limit, capsys):
    with pytest.raises(SystemExit) as exc:
        tokenmill(["eval", "--model", "m", "--tasks", "tokenmill_mc", "--limit", limit])
    assert exc.value.code == 2
    assert "--limit: must be a whole number of examples per task (>= 1) or a fraction in (0, 1)" in capsys.readouterr().err


def test_a_fractional_limit_is_taken():
    from tokenmill.cli.commands.eval import limit_value

    assert limit_value("0.25") == 0.25 and limit_value("7") == 7 and isinstance(limit_value("7.0"), int)


def test_without_lm_eval_the_command_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    err = _fail(capsys, ["eval", "--model", "m", "--tasks", "tokenmill_mc"])
    assert "lm-eval is not installed: pip install 'tokenmill[eval]'" in err


def test_flags_of_the_other_mode_are_refused_not_ignored(capsys):
    err = _fail(capsys, ["eval", "--model", "m", "--tasks", "tokenmill_mc", "--state", "s.sqlite", "--timeout", "5"])
    assert "--state, --timeout only work(s) through Kafka: add --bootstrap-servers" in err
    err = _fail(capsys, ["eval", "--model", "m", "--tasks", "tokenmill_mc", "--bootstrap-servers", "h:1",
                         "--max-num-seqs", "8", "--no-prefix-caching"])
    assert "--max-num-seqs, --no-prefix-caching set(s) the local engine" in err


def test_a_missing_include_path_is_refused(capsys, tmp_path):
    err = _fail(capsys, ["eval", "--model", "m", "--tasks", "tokenmill_mc", "--include-path", str(tmp_path / "nope")])
    assert "--include-path" in err and "not a folder" in err


def test_the_offline_variables_are_set_unless_the_user_set_them(monkeypatch):
    from tokenmill.cli.commands.eval import _set_offline

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    _set_offline()
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "0"


def test_fleet_scoring_jobs_of_one_context_share_a_partition_key():
    """The choices of one question go to one partition (one worker's prefix cache computes the
    context once); other questions and non-scoring jobs spread by job id."""
    from tokenmill.eval.kafka_runner import ContextKeyedBackend, KafkaSettings
    from tokenmill.schemas import Job

    def scoring(job_id, context, continuation):
        return Job.model_validate({"job_id": job_id, "prompt_token_ids": context + continuation, "sampling": {
            "max_tokens": 0, "prompt_logprobs": 0, "score_from": len(context)}})

    backend = ContextKeyedBackend(KafkaSettings("127.0.0.1:9"), "eval-x-")
    header = list(range(10, 60))
    q1, q2 = header + [1, 2, 3], header + [4, 5, 6]  # the same few-shot header, different questions
    keys = [backend.partition_key(scoring(f"eval-x-ll-{i}", q1, [70 + i, 80])) for i in range(4)]
    assert len(set(keys)) == 1 and keys[0].startswith(b"ctx-")
    assert backend.partition_key(scoring("eval-x-ll-9", q2, [70])) != keys[0]
    gen = Job.model_validate({"job_id": "eval-x-gen-0", "prompt_token_ids": q1, "sampling": {"max_tokens": 4}})
    assert backend.partition_key(gen) == b"eval-x-gen-0"


def test_eval_with_the_chat_template_equals_lm_eval_in_process(tiny_llama_dir, tmp_path, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tokenmill.eval import TASKS_DIR
    from tokenmill.eval.lm import TokenmillLM
    from tokenmill.eval.local_runner import LocalJobRunner

    out = tmp_path / "chat.json"
    assert tokenmill(["eval", "--model", str(tiny_llama_dir), "--tasks", "tokenmill_mc", "--limit", "2",
                      "--apply-chat-template", "--system-instruction", "Answer briefly.", "--bootstrap-iters", "0",
                      "--output", str(out), "--no-progress"]) == 0
    got = metrics(json.loads(out.read_text()))
    runner = LocalJobRunner(tiny_llama_dir)
    try:
        lm = TokenmillLM(runner.tokenizer, runner, model_name=runner.model_name, max_length=runner.max_length)
        seen = []
        run = lm._loglikelihood_tokens

        def recording(requests, *a, **kw):
            seen.extend(requests)
            return run(requests, *a, **kw)

        lm._loglikelihood_tokens = recording
        want = metrics(lm_eval.simple_evaluate(
            model=lm, tasks=["tokenmill_mc"], limit=2, bootstrap_iters=0, log_samples=False,
            apply_chat_template=True, system_instruction="Answer briefly.",
            task_manager=TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False)))
    finally:
        runner.close()
    assert got == want
    (context, _), _, _ = seen[0]
    assert "Answer briefly." in context  # the system message went through the template
    assert tokenmill(["eval", "--model", str(tiny_llama_dir), "--tasks", "tokenmill_mc",
                      "--fewshot-as-multiturn"]) == 2
    assert "needs --apply-chat-template" in capsys.readouterr().err
