"""`tokenmill run-batch`: one output line per input line, in order; broken lines get error Results."""

import json

import pytest

from tokenmill.cli import main

BROKEN = {
    7: "{this is not json",
    23: {"custom_id": "bad-n", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "n": 65}},
    41: {"custom_id": "bad-max", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello", "max_tokens": 0}},
    66: {"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "some-other-model", "prompt": "hello", "max_tokens": 3}},
    90: {"custom_id": "bad-field", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello", "max_tokens": 3}, "priority_boost": 1},
}


def good_line(i, model):
    if i % 2:
        body = {"model": model, "messages": [{"role": "user", "content": f"question number {i}"}],
                "max_tokens": 1 + i % 5, "temperature": 0}
        url = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": f"the model said {i} times", "max_tokens": 1 + i % 4,
                "temperature": 0.7, "seed": i}
        url = "/v1/completions"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    model = tiny_qwen2_dir.name
    with open(path, "w") as f:
        for i in range(100):
            line = BROKEN.get(i, good_line(i, model))
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def run_batch(tmp_path, model_dir, batch_file, fmt):
    out = tmp_path / f"out-{fmt}.jsonl"
    code = main(["run-batch", "--model", str(model_dir), str(batch_file), str(out), "--output-format", fmt,
                 "--kv-cache-gb", "0.02", "--max-num-seqs", "16", "--no-progress"])
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_openai_file_with_broken_lines_tokenmill_output(tmp_path, tiny_qwen2_dir, batch_file):
    results = run_batch(tmp_path, tiny_qwen2_dir, batch_file, "tokenmill")
    assert len(results) == 100
    ok = [r for r in results if r["status"] == "ok"]
    errors = [r for r in results if r["status"] == "error"]
    assert len(ok) == 95 and len(errors) == 5
    # Input order is kept; custom_id becomes job_id.
    for i, r in enumerate(results):
        if i in BROKEN:
            assert r["status"] == "error"
            assert r["error"]["code"] in ("invalid_job", "model_mismatch") and r["error"]["message"]
        else:
            assert r["job_id"] == f"req-{i}"
            assert r["usage"]["completion_tokens"] >= 1 and len(r["token_ids"]) == r["usage"]["completion_tokens"]
            assert r["finish_reason"] in ("stop", "length")
    by_id = {r["job_id"]: r for r in errors}
    assert results[7]["job_id"] == "line-8"  # unreadable line: named by its line number
    assert "n" in by_id["bad-n"]["error"]["message"]
    assert "max_tokens" in by_id["bad-max"]["error"]["message"]
    assert by_id["bad-model"]["error"]["code"] == "model_mismatch"
    assert "priority_boost" in by_id["bad-field"]["error"]["message"]


def test_openai_output_format(tmp_path, tiny_qwen2_dir, batch_file):
    lines = run_batch(tmp_path, tiny_qwen2_dir, batch_file, "openai")
    assert len(lines) == 100
    assert [ln["custom_id"] for ln in lines if ln["custom_id"].startswith("req-")] == [
        f"req-{i}" for i in range(100) if i not in BROKEN
    ]
    ok = [ln for ln in lines if ln["response"] and ln["response"]["status_code"] == 200]
    assert len(ok) == 95
    chat = next(ln for ln in ok if ln["custom_id"] == "req-1")
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert sum(1 for ln in lines if ln["response"] and ln["response"]["status_code"] == 400) == 5


def test_an_s3_model_is_served_under_its_last_path_part():
    from argparse import Namespace

    from tokenmill.cli.commands.run_batch import served_model_name

    assert served_model_name(Namespace(model="s3://bucket/models/qwen-tiny/", served_model_name=None)) == "qwen-tiny"
    assert served_model_name(Namespace(model="s3://bucket/models/qwen-tiny", served_model_name="given")) == "given"
    assert served_model_name(Namespace(model="/local/dir", served_model_name=None)) is None


def test_openai_lines_with_n_get_n_choices(tmp_path, tiny_qwen2_dir):
    model = tiny_qwen2_dir.name
    lines = [
        {"custom_id": "chat-n", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4,
                  "seed": 5, "logprobs": True, "top_logprobs": 1}},
        {"custom_id": "cmpl-n", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "once upon", "n": 2, "max_tokens": 3, "seed": 9}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "once upon", "max_tokens": 3, "seed": 10}},
    ]
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = run_batch(tmp_path, tiny_qwen2_dir, path, "openai")
    chat, cmpl, single = (line["response"]["body"] for line in out)
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) >= 1 for c in chat["choices"])
    assert [c["index"] for c in cmpl["choices"]] == [0, 1]
    assert cmpl["choices"][1]["text"] == single["choices"][0]["text"]  # choice 1 drew with seed 9 + 1
    assert 2 <= cmpl["usage"]["completion_tokens"] <= 6  # both choices' tokens (EOS may end one early)
