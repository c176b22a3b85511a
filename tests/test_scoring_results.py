"""Scoring jobs end to end on the offline driver: a Job with sampling.prompt_logprobs gets a
Result whose prompt_logprobs (with token texts), prompt_logprob_sum and is_greedy equal
transformers' log_softmax over the prompt; max_tokens 0 scores only; an n > 1 job gets its
choices, each equal to the single job with its seed."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig
from tokenmill.offline import OfflineRunner
from tokenmill.schemas import Job

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_num_seqs=8))


def _run(engine, jobs):
    runner = OfflineRunner(engine, worker="score-test", max_in_flight=8)
    answered = []
    for i, j in enumerate(jobs):
        refused = runner.add(j, i)
        if refused is not None:
            answered.append((i, refused))
    while runner.in_flight:
        answered.extend(runner.step())
    return {tag: result for tag, result in answered}


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_a_scoring_job_gets_the_prompt_logprobs_in_its_result(engine, tiny_llama_dir):
    ids = [5, 77, 301, 12, 9, 400, 1200, 33, 64, 7, 88, 910]
    jobs = [
        Job.model_validate({"job_id": "score", "prompt_token_ids": ids,
                            "sampling": {"prompt_logprobs": 2, "max_tokens": 0}}),
        Job.model_validate({"job_id": "tail", "prompt_token_ids": ids,
                            "sampling": {"prompt_logprobs": 0, "score_from": 8, "max_tokens": 3,
                                         "temperature": 0.0}}),
    ]
    results = _run(engine, jobs)
    ref = _hf_logprobs(tiny_llama_dir, ids)
    score = results[0]
    assert score.status == "ok", score.error
    assert (score.text, score.token_ids, score.finish_reason, score.usage.completion_tokens) == ("", [], "length", 0)
    assert len(score.prompt_logprobs) == len(ids) - 1
    total = 0.0
    for pos, record in enumerate(score.prompt_logprobs, start=1):
        want = ref[pos - 1]
        assert record.token_id == ids[pos]
        assert abs(record.logprob - float(want[ids[pos]])) < TOL
        assert record.rank == 1 + int((want > want[ids[pos]]).sum())
        assert record.token == engine.tokenizer.decode([ids[pos]], skip_special_tokens=False)
        top = want.topk(2)
        assert [t.token_id for t in record.top_logprobs] == top.indices.tolist()
        assert all(t.token == engine.tokenizer.decode([t.token_id], skip_special_tokens=False)
                   for t in record.top_logprobs)
        total += record.logprob
    assert math.isclose(score.prompt_logprob_sum, total, abs_tol=1e-3)
    assert score.is_greedy == all(r.rank == 1 for r in score.prompt_logprobs)
    tail = results[1]
    assert tail.status == "ok" and len(tail.token_ids) == 3
    assert [r.token_id for r in tail.prompt_logprobs] == ids[8:]
    assert all(r.top_logprobs == [] for r in tail.prompt_logprobs)
    # The JSON form validates against the wire's Result (round trip).
    from tokenmill.schemas import Result

    assert Result.model_validate_json(score.model_dump_json()) == score


def test_an_n_job_gets_its_choices_each_equal_to_a_single_seeded_job(engine):
    sampling = {"max_tokens": 6, "temperature": 0.8, "seed": 41, "ignore_eos": True, "logprobs": 1}
    jobs = [Job.model_validate({"job_id": "many", "prompt": "hi there", "sampling": {**sampling, "n": 3}})]
    jobs += [Job.model_validate({"job_id": f"one{i}", "prompt": "hi there", "sampling": {**sampling, "seed": 41 + i}})
             for i in range(3)]
    results = _run(engine, jobs)
    many = results[0]
    assert many.status == "ok", many.error
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        single = results[1 + i]
        assert (choice.token_ids, choice.text, choice.finish_reason) == (single.token_ids, single.text, "length")
        assert choice.completion_tokens == 6 and [r.token_id for r in choice.logprobs] == choice.token_ids
    assert (many.text, many.token_ids) == (many.choices[0].text, many.choices[0].token_ids)
    assert many.usage.completion_tokens == 18 and many.usage.prompt_tokens == results[1].usage.prompt_tokens
    from tokenmill.schemas import Result

    assert Result.model_validate_json(many.model_dump_json()) == many


def test_n_with_what_it_does_not_combine_with_is_refused_clearly(engine):
    results = _run(engine, [Job.model_validate({"job_id": "many", "prompt": "hi",
                                                "sampling": {"n": 2, "max_tokens": 0, "prompt_logprobs": 0}})])
    refused = results[0]
    assert refused.status == "error" and refused.error.code == "invalid_job"
    assert "n > 1 needs max_tokens >= 1" in refused.error.message


def test_run_batch_echo_logprobs_line_gives_the_prompt_logprobs_in_openai_shape(tmp_path, tiny_llama_dir):
    """The line lm-eval's local-completions model sends: echo + logprobs, max_tokens 0."""
    import json

    from tokenmill.cli import main

    batch = tmp_path / "echo.jsonl"
    lines = [
        {"custom_id": "ll-0", "method": "POST", "url": "/v1/completions",
         "body": {"model": tiny_llama_dir.name, "prompt": "the cat sat on the mat", "max_tokens": 0,
                  "echo": True, "logprobs": 1, "temperature": 0}},
        {"custom_id": "chat-0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4}},
    ]
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "--model", str(tiny_llama_dir), str(batch), str(out), "--output-format", "openai",
                 "--no-progress"]) == 0
    echo, chat = [json.loads(line) for line in out.read_text().splitlines()]
    assert echo["error"] is None and echo["response"]["status_code"] == 200
    choice = echo["response"]["body"]["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None  # the first prompt token has no logprob
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) >= 2
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    assert choice["text"] == "".join(logprobs["tokens"])
    assert chat["response"]["status_code"] == 200


def test_backfill_refuses_prompt_logprobs_in_openai_output(tmp_path, capsys, tiny_llama_dir):
    import json

    from tokenmill.cli import main

    inp = tmp_path / "rows.jsonl"
    inp.write_text(json.dumps({"text": "a b c"}) + "\n")
    code = main(["backfill", "--engine", "local", "--model", str(tiny_llama_dir), "--input", str(inp),
                 "--output", str(tmp_path / "out.jsonl"), "--prompt-column", "text", "--no-progress",
                 "--output-format", "openai", "--sampling", '{"prompt_logprobs": 0, "max_tokens": 1}'])
    assert code == 2
    assert "cannot carry prompt_logprobs" in capsys.readouterr().err
