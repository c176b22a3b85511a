"""tokenmill backfill with the in-process engine (no Kafka): ids, resume, reruns, formats, S3."""

import csv
import gzip
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import boto3
import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.tools.backfill import BackfillConfig, JobSpec, run_backfill_sync
from tokenmill.tools.backfill.datasets import DatasetError, count_rows, detect_format, iter_rows
from tokenmill.tools.backfill.identity import fingerprint, job_id_for
from tokenmill.tools.backfill.jobs import RowError

REPO = Path(__file__).resolve().parents[1]


def _rows(n):
    return [{"id": f"q{i:03d}", "text": f"question {i} about kafka", "n": i} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _cfg(tmp_path, model_dir, inp, out, **kw):
    spec = kw.pop("spec", None) or JobSpec(prompt_template="Answer: {text}", sampling={"max_tokens": 3, "temperature": 0})
    return BackfillConfig(input=str(inp), output=str(out), spec=spec, engine="local", model_path=str(model_dir),
                          key_column="id", progress=False, **kw)


def test_job_ids_are_stable_and_change_with_what_decides_the_output():
    row = {"text": "hello", "n": 1}
    a = job_id_for("ds", 7, fingerprint(row), "cfg")
    assert a == job_id_for("ds", 7, fingerprint(dict(reversed(list(row.items())))), "cfg")
    assert a.startswith("bf-") and "-000000007-" in a and len(a) <= 256
    assert a != job_id_for("ds", 8, fingerprint(row), "cfg")
    assert a != job_id_for("ds", 7, fingerprint({"text": "hello!", "n": 1}), "cfg")
    assert a != job_id_for("ds", 7, fingerprint(row), "cfg2")
    assert a != job_id_for("other", 7, fingerprint(row), "cfg")
    base = JobSpec(prompt_template="Q: {text}", model="m", sampling={"max_tokens": 3})
    for changed in (
        JobSpec(prompt_template="Q2: {text}", model="m", sampling={"max_tokens": 3}),
        JobSpec(prompt_template="Q: {text}", model="m2", sampling={"max_tokens": 3}),
        JobSpec(prompt_template="Q: {text}", model="m", sampling={"max_tokens": 4}),
        JobSpec(prompt_column="text", model="m", sampling={"max_tokens": 3}),
    ):
        assert changed.fingerprint() != base.fingerprint()
    assert base.fingerprint() == JobSpec(prompt_template="Q: {text}", model="m", sampling={"max_tokens": 3}).fingerprint()
    # Same meaning, same fingerprint: 0 and 0.0, an explicit default.
    assert JobSpec(prompt_column="t", sampling={"temperature": 0}).fingerprint() == JobSpec(
        prompt_column="t", sampling={"temperature": 0.0, "top_p": 1.0}).fingerprint()
    with pytest.raises(ValueError, match="max_tokens"):
        JobSpec(prompt_column="t", sampling={"max_tokens": 0})


def test_row_to_job_mappings():
    assert JobSpec(prompt_template="Q: {text}").job_dict("j", 0, {"text": "hi"})["prompt"] == "Q: hi"
    chat = JobSpec(prompt_column="text", system_prompt="Be brief.").job_dict("j", 0, {"text": "hi"})
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    msgs = JobSpec(messages_column="m").job_dict("j", 2, {"m": json.dumps([{"role": "user", "content": "x"}])})
    assert msgs["messages"] == [{"role": "user", "content": "x"}] and msgs["metadata"] == {"row": 2}
    with pytest.raises(RowError, match="column 'text'"):
        JobSpec(prompt_template="Q: {text}").job_dict("j", 0, {"other": 1})
    with pytest.raises(RowError, match="list of"):
        JobSpec(messages_column="m").job_dict("j", 0, {"m": "not json"})
    with pytest.raises(ValueError, match="exactly one"):
        JobSpec(prompt_template="{a}", prompt_column="a")
    with pytest.raises(ValueError, match="names no column"):
        JobSpec(prompt_template="no fields")


def test_dataset_readers_stream_the_same_rows(tmp_path):
    rows = [{"id": "a", "text": "x, \"quoted\"\nnewline"}, {"id": "b", "text": "y"}]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["id", "text"])
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.jsonl.gz", "d.csv", "d.parquet"):
        fmt = detect_format(name)
        assert list(iter_rows(tmp_path / name, fmt)) == rows, name
        assert count_rows(tmp_path / name, fmt) == 2
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DatasetError, match="line 2"):
        list(iter_rows(tmp_path / "bad.jsonl", "jsonl"))
    with pytest.raises(DatasetError, match="format"):
        detect_format("data.txt")


def test_local_backfill_reruns_template_change_and_retry(tmp_path, tiny_llama_dir):
    rows = _rows(12)
    rows.append({"id": "q-long", "text": "kafka " * 3000, "n": 12})  # longer than the model allows
    rows.append({"id": "q-bad", "n": 13})  # no text column: an invalid row, still one output row
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"

    first = run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out))
    assert (first.rows, first.ok, first.error, first.submitted, first.invalid_rows) == (14, 12, 2, 13, 1)
    got = _read_jsonl(out)
    assert [r["row"] for r in got] == list(range(14))
    assert [r["key"] for r in got] == [r["id"] for r in rows]
    assert all(r["status"] == "ok" and r["usage"]["completion_tokens"] == 3 for r in got[:12])
    assert got[12]["error_code"] == "prompt_too_long" and got[13]["error_code"] == "invalid_job"
    assert "text" in got[13]["error_message"]
    assert all(r["latency_ms"] is not None for r in got[:13])

    # Nothing changed: no job at all, same output.
    again = run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out))
    assert again.submitted == 0 and again.new_results == 0
    assert [(r["job_id"], r["text"]) for r in _read_jsonl(out)] == [(r["job_id"], r["text"]) for r in got]

    # --retry-failed resubmits exactly the failed rows (and they fail again, honestly).
    retry = run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out, retry_failed=True))
    assert (retry.submitted, retry.invalid_rows, retry.error) == (1, 1, 2)

    # A changed template: new job ids and new results for every row.
    spec = JobSpec(prompt_template="Please answer: {text}", sampling={"max_tokens": 3, "temperature": 0})
    changed = run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out, spec=spec))
    assert changed.submitted == 13 and changed.new_results == 14
    new = _read_jsonl(out)
    assert len(new) == 14
    assert not {r["job_id"] for r in new} & {r["job_id"] for r in got}
    assert all(r["usage"]["prompt_tokens"] > o["usage"]["prompt_tokens"] for r, o in zip(new[:12], got[:12], strict=True))


def test_local_backfill_openai_output(tmp_path, tiny_llama_dir):
    inp = _write_jsonl(tmp_path / "in.jsonl", _rows(3))
    out = tmp_path / "out.jsonl"
    spec = JobSpec(prompt_column="text", system_prompt="Be brief.", sampling={"max_tokens": 2, "temperature": 0})
    run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out, spec=spec, output_format="openai"))
    lines = _read_jsonl(out)
    assert len(lines) == 3
    for line in lines:
        assert line["custom_id"].startswith("bf-") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 2
        assert isinstance(body["choices"][0]["message"]["content"], str)


def _results_in_state(state: Path) -> int:
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_s3_parquet_backfill_killed_halfway_then_resumed(tmp_path, tiny_llama_dir, s3_bucket):
    """Done-when: 300-row Parquet on S3 -> Parquet on S3, 300 rows in input order; a run killed
    halfway and resumed leaves no row missing and no row twice."""
    rows = _rows(300)
    local_in = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), local_in, row_group_size=64)
    s3 = boto3.client("s3")
    s3.upload_file(str(local_in), s3_bucket, "datasets/questions.parquet")
    inp, out = f"s3://{s3_bucket}/datasets/questions.parquet", f"s3://{s3_bucket}/outputs/answers.parquet"
    state = tmp_path / "state.sqlite"
    cmd = [
        sys.executable, "-m", "tokenmill.cli", "backfill", "--engine", "local", "--model", str(tiny_llama_dir),
        "--input", inp, "--output", out, "--state", str(state), "--prompt-template", "Answer: {text}",
        "--key-column", "id", "--max-tokens", "6", "--temperature", "0", "--max-in-flight", "4", "--no-progress",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while _results_in_state(state) < 60 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, output
    done_before = _results_in_state(state)
    assert 0 < done_before < 300, done_before
    with pytest.raises(s3.exceptions.ClientError):
        s3.head_object(Bucket=s3_bucket, Key="outputs/answers.parquet")  # nothing half-written

    resumed = run_backfill_sync(BackfillConfig(
        input=inp, output=out, state=str(state), engine="local", model_path=str(tiny_llama_dir), key_column="id",
        spec=JobSpec(prompt_template="Answer: {text}", sampling={"max_tokens": 6, "temperature": 0}), progress=False,
    ))
    assert resumed.submitted == 300 - done_before
    assert (resumed.rows, resumed.ok) == (300, 300)

    s3.download_file(s3_bucket, "outputs/answers.parquet", str(tmp_path / "answers.parquet"))
    table = pq.read_table(tmp_path / "answers.parquet")
    assert table.num_rows == 300
    assert table.column("row").to_pylist() == list(range(300))
    assert table.column("key").to_pylist() == [r["id"] for r in rows]
    assert len(set(table.column("job_id").to_pylist())) == 300
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert [u["completion_tokens"] for u in table.column("usage").to_pylist()] == [6] * 300


def test_cli_csv_messages_column_to_local_parquet(tmp_path, tiny_llama_dir, capsys):
    from tokenmill.cli import main

    path = tmp_path / "chats.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["id", "conversation"])
        w.writeheader()
        for i in range(4):
            w.writerow({"id": f"c{i}", "conversation": json.dumps(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"hello {i}"}])})
        w.writerow({"id": "c-bad", "conversation": "[not json"})
    out = tmp_path / "answers.parquet"
    args = ["backfill", "--engine", "local", "--model", str(tiny_llama_dir), "--input", str(path),
            "--output", str(out), "--messages-column", "conversation", "--key-column", "id",
            "--max-tokens", "2", "--temperature", "0", "--no-progress", "--summary-json", str(tmp_path / "s.json")]
    assert main(args) == 0
    table = pq.read_table(out).to_pylist()
    assert [r["key"] for r in table] == ["c0", "c1", "c2", "c3", "c-bad"]
    assert [r["status"] for r in table] == ["ok"] * 4 + ["error"]
    assert table[4]["error_code"] == "invalid_job" and "conversation" in table[4]["error_message"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["rows"], summary["ok"], summary["error"], summary["submitted"]) == (5, 4, 1, 4)
    assert "backfill: 5 rows -> ok 4, error 1" in capsys.readouterr().err
    # Bad arguments are refused before anything runs.
    assert main([*args, "--prompt-column", "id"]) == 2
    assert "exactly one of" in capsys.readouterr().err


LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["bug", "question", "praise"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 2}},
    "required": ["label", "score", "tags"],
    "additionalProperties": False,
}


def test_cli_refuses_bad_constraint_options_before_anything_runs(tmp_path, tiny_llama_dir, capsys):
    from tokenmill.cli import main

    inp = _write_jsonl(tmp_path / "in.jsonl", _rows(2))
    (tmp_path / "schema.json").write_text(json.dumps(LABEL_SCHEMA))
    (tmp_path / "broken.json").write_text("{'type': 'object'}")
    (tmp_path / "text.json").write_text('"an object, please"')
    (tmp_path / "pattern.json").write_text(json.dumps({"type": "string", "pattern": "(unclosed"}))
    (tmp_path / "ref.json").write_text(json.dumps({"$ref": "#/$defs/nope"}))
    # A real model: a missing one is refused first, before the constraint is looked at.
    base = ["backfill", "--engine", "local", "--model", str(tiny_llama_dir), "--input", str(inp),
            "--output", str(tmp_path / "out.jsonl"), "--prompt-column", "text", "--no-progress"]
    for extra, message in (
        (["--json-schema", str(tmp_path / "missing.json")], "--json-schema: no such file"),
        (["--json-schema", str(tmp_path / "broken.json")], "broken.json is not JSON"),
        (["--json-schema", str(tmp_path / "text.json")], "holds a JSON string, not a JSON Schema object"),
        (["--json-schema", str(tmp_path / "schema.json"), "--choice", "a"], "exclusive"),
        (["--choice", "a", "--whitespace", "flexible"], "--whitespace goes with --json-schema"),
        (["--choice", "a", "--sampling", '{"structured_outputs": {"regex": "a"}}'], "give the constraint once"),
        (["--sampling", '{"structured_outputs": {"json": "[1]"}}'], "structured_outputs.json"),
        # Shaped right, but the matcher refuses it: it would fail every row, so the run stops first.
        (["--json-schema", str(tmp_path / "pattern.json")], "does not compile: invalid json constraint: regex parse error"),
        (["--json-schema", str(tmp_path / "ref.json")], "does not compile: invalid json constraint: Pointer '/$defs/nope' does not exist"),
        (["--sampling", '{"structured_outputs": {"grammar": "start: nothing_here"}}'], "unknown name"),
    ):
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.state.sqlite").exists()


def test_local_backfill_with_a_json_schema_or_choices_fills_the_parsed_column(tmp_path, tiny_llama_dir, capsys):
    """Every row whose output ended with finish_reason stop has a parsed value that validates
    (or is one of the choices); a row cut by max_tokens gets null there and keeps its raw text."""
    from tokenmill.cli import main

    inp = _write_jsonl(tmp_path / "in.jsonl", _rows(6))
    schema = tmp_path / "label.json"
    schema.write_text(json.dumps(LABEL_SCHEMA))
    base = ["backfill", "--engine", "local", "--model", str(tiny_llama_dir), "--input", str(inp),
            "--prompt-template", "Label this issue as JSON: {text}", "--key-column", "id", "--no-progress",
            "--temperature", "0"]
    out = tmp_path / "labels.jsonl"
    assert main([*base, "--output", str(out), "--json-schema", str(schema), "--max-tokens", "64"]) == 0
    rows = _read_jsonl(out)
    assert [r["finish_reason"] for r in rows] == ["stop"] * 6  # the grammar bounds the output
    for r in rows:
        jsonschema.validate(r["parsed"], LABEL_SCHEMA)
        assert json.loads(r["text"]) == r["parsed"] and " " not in r["text"]  # compact whitespace
    assert "parsed 6, unparsed 0" in capsys.readouterr().err

    # Cut short: the same rows under a new id (max_tokens is part of it), null parsed, raw text kept.
    cut = tmp_path / "cut.parquet"
    assert main([*base, "--output", str(cut), "--json-schema", str(schema), "--max-tokens", "3"]) == 0
    table = pq.read_table(cut).to_pylist()
    assert [r["finish_reason"] for r in table] == ["length"] * 6 and all(r["parsed"] is None for r in table)
    assert all(r["text"].startswith('{"') for r in table)
    assert not {r["job_id"] for r in table} & {r["job_id"] for r in rows}
    assert "parsed 0, unparsed 6" in capsys.readouterr().err

    labels = tmp_path / "choices.parquet"
    choices = ["bug report", "question", "praise"]
    args = [*base, "--output", str(labels), "--max-tokens", "8", "--summary-json", str(tmp_path / "s.json")]
    assert main([*args, *[a for c in choices for a in ("--choice", c)]]) == 0
    table = pq.read_table(labels).to_pylist()
    assert all(r["finish_reason"] == "stop" and r["parsed"] in choices and r["parsed"] == r["text"] for r in table)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["ok"], summary["parsed"], summary["unparsed"]) == (6, 6, 0)


def test_local_backfill_with_n_samples_writes_every_choice(tmp_path, tiny_llama_dir):
    """sampling.n > 1: the `texts` column holds every choice (text is choice 0's); OpenAI output
    gets n body choices."""
    inp = _write_jsonl(tmp_path / "in.jsonl", _rows(3))
    sampling = {"max_tokens": 3, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    spec = JobSpec(prompt_template="Answer: {text}", sampling=sampling)
    out = tmp_path / "out.jsonl"
    run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, out, spec=spec))
    rows = _read_jsonl(out)
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "ok" and len(row["texts"]) == 3 and row["texts"][0] == row["text"]
        assert row["usage"]["completion_tokens"] == 9
    parquet = tmp_path / "out.parquet"
    run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, parquet, spec=spec))
    table = pq.read_table(parquet).to_pylist()
    assert [r["texts"] for r in table] == [r["texts"] for r in rows]  # seeded: the same samples
    openai = tmp_path / "openai.jsonl"
    run_backfill_sync(_cfg(tmp_path, tiny_llama_dir, inp, openai, spec=spec, output_format="openai"))
    for line, row in zip(_read_jsonl(openai), rows, strict=True):
        choices = line["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert [c["text"] for c in choices] == row["texts"]
