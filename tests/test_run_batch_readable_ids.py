"""run-batch reads input lines with the contract decoder: a line whose id can be read but whose
other fields cannot be decoded gets its error Result under that id, not a line number."""

import json

from tokenmill.cli import main


def test_run_batch_answers_an_undecodable_line_under_its_readable_id(tmp_path, tiny_qwen2_dir):
    lines = [
        b'{"job_id": "sur-job", "prompt": "a lone \\ud800 surrogate", "sampling": {"max_tokens": 2}}',
        b'{"custom_id": "sur-line", "method": "POST", "url": "/v1/completions", '
        b'"body": {"prompt": "\\udfff", "max_tokens": 2}}',
        b'{"job_id": "a", "job_id": "b", "prompt": "\\ud800"}',  # the id itself is ambiguous
        json.dumps({"job_id": "fine", "prompt": "hello", "sampling": {"max_tokens": 2, "temperature": 0}}).encode(),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    code = main(["run-batch", "--model", str(tiny_qwen2_dir), str(src), str(out), "--kv-cache-gb", "0.02",
                 "--max-num-seqs", "4", "--no-progress"])
    assert code == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["job_id"] for r in results] == ["sur-job", "sur-line", "line-3", "fine"]
    assert [r["status"] for r in results] == ["error", "error", "error", "ok"]
    assert all("surrogate" in r["error"]["message"] for r in results[:2])
    assert "duplicate key 'job_id'" in results[2]["error"]["message"]
