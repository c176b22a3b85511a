"""Every command that loads a model checks its arguments, files, model and broker first: a bad one
exits 2 with one line per problem, before torch is imported or anything loads."""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tokenmill.cli import main, preflight
from tokenmill.engine.checkpoint_files import checkpoint_problems

# The bar: a missing input file fails in under 2 s (a model load takes 7-12 s).
FAIL_FAST_S = 2.0


def _cli(*argv: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`python -X importtime -m tokenmill.cli ...` in a fresh process: (the run, its wall seconds)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tokenmill.cli", *argv],
                          capture_output=True, text=True, timeout=120, env=env)
    return done, time.perf_counter() - t0


def _imported(stderr: str) -> set[str]:
    """Top-level module names that -X importtime reports."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def _messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def test_run_batch_with_a_missing_input_fails_in_under_two_seconds_without_importing_torch(tmp_path, tiny_llama_dir):
    done, wall = _cli("run-batch", "--model", str(tiny_llama_dir), str(tmp_path / "missing.jsonl"),
                      str(tmp_path / "out.jsonl"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert _messages(done.stderr) == [f"tokenmill run-batch: input {tmp_path / 'missing.jsonl'}: no such file"]
    assert not {"torch", "transformers", "aiokafka", "boto3"} & _imported(done.stderr)
    assert wall < FAIL_FAST_S, f"took {wall:.2f}s"
    assert not (tmp_path / "out.jsonl").exists()


def test_every_problem_is_reported_at_once_each_on_its_own_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    done, _ = _cli("run-batch", "--model", str(tmp_path / "no-model"), str(tmp_path / "missing.jsonl"),
                   str(tmp_path / "a-file" / "out.jsonl"))
    assert done.returncode == 2
    assert _messages(done.stderr) == [
        f"tokenmill run-batch: input {tmp_path / 'missing.jsonl'}: no such file",
        f"tokenmill run-batch: output {tmp_path / 'a-file' / 'out.jsonl'}: {tmp_path / 'a-file'} is a file, not a folder",
        f"tokenmill run-batch: --model: model folder not found: {tmp_path / 'no-model'}",
    ]


@pytest.fixture
def broken_model(tmp_path, tiny_llama_dir):
    """A copy of a tiny checkpoint, for a test to take parts of away."""
    target = tmp_path / "broken-model"
    shutil.copytree(tiny_llama_dir, target)
    return target


def test_a_model_folder_without_weights_is_named_in_the_error(tmp_path, broken_model, capsys):
    for weights in broken_model.glob("*.safetensors*"):
        weights.unlink()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"job_id": "a", "prompt": "hi"}) + "\n")
    assert main(["run-batch", "--model", str(broken_model), str(inp), str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tokenmill run-batch: --model: {broken_model} has no weights: expected model.safetensors "
                   "or model.safetensors.index.json with shards")


def test_an_unsupported_architecture_and_a_missing_tokenizer_are_named(broken_model):
    config = json.loads((broken_model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (broken_model / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"):
        (broken_model / name).unlink(missing_ok=True)
    problems = checkpoint_problems(broken_model)
    assert problems == [
        f"{broken_model / 'config.json'}: unsupported architecture 'gpt2'; supported: LlamaForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM",
        f"{broken_model} has no tokenizer (expected one of tokenizer.json, tokenizer.model, vocab.json, "
        "tokenizer_config.json)",
    ]


def test_a_checkpoint_for_vllm_may_be_of_any_architecture_with_bin_weights(broken_model):
    config = json.loads((broken_model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (broken_model / "config.json").write_text(json.dumps(config))
    for weights in broken_model.glob("*.safetensors*"):
        weights.rename(weights.with_name("pytorch_model.bin"))
    assert preflight.model(str(broken_model), backend="vllm") == []
    assert preflight.model(str(broken_model), weights=False, backend=None) == []  # a fleet's unknown engine
    assert len(preflight.model(str(broken_model))) == 2  # tokenmill's engine: the architecture, the weights


def test_a_whole_checkpoint_passes_and_the_tokenizer_only_check_skips_the_weights(tiny_model_dir, broken_model):
    assert checkpoint_problems(tiny_model_dir) == []
    for weights in broken_model.glob("*.safetensors*"):
        weights.unlink()
    assert checkpoint_problems(broken_model, weights=False) == []
    assert len(checkpoint_problems(broken_model)) == 1


def test_run_batch_refuses_to_write_over_its_own_input(tmp_path, tiny_llama_dir, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"job_id": "a", "prompt": "hi"}) + "\n")
    assert main(["run-batch", "--model", str(tiny_llama_dir), str(inp), str(inp)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert inp.read_text() == json.dumps({"job_id": "a", "prompt": "hi"}) + "\n"  # untouched


def test_a_worker_with_a_bad_model_exits_2_at_once_instead_of_waiting_for_the_broker(tmp_path):
    from tokenmill.kafka.local_broker import free_port

    done, wall = _cli("worker", "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--model", str(tmp_path / "nope"),
                      "--broker-wait-timeout", "60")
    assert done.returncode == 2, done.stderr[-2000:]
    assert _messages(done.stderr) == [f"tokenmill worker: --model: model folder not found: {tmp_path / 'nope'}"]
    assert "torch" not in _imported(done.stderr)
    assert wall < 10, f"took {wall:.2f}s"


@pytest.mark.parametrize("command, expected", [
    (["bench", "--workload", "mixed", "--model", "{missing}"], "tokenmill bench: --model: model folder not found"),
    (["bench", "--workload", "mixed", "--model", "tiny-llama", "--json", "{file}/r.json"],
     "tokenmill bench: --json {file}/r.json: {file} is a file, not a folder"),
    (["bench", "--workload", "mixed", "--model", "tiny-llama", "--bootstrap-servers", "h:1"],
     "tokenmill bench: --bootstrap-servers is an option of --workload kafka"),
    (["eval", "--model", "{missing}", "--tasks", "tokenmill_mc"], "tokenmill eval: --model: model folder not found"),
    (["eval", "--model", "{model}", "--tasks", "tokenmill_mc", "--output", "{file}/r.json"],
     "tokenmill eval: --output {file}/r.json: {file} is a file, not a folder"),
    (["backfill", "--engine", "local", "--model", "{missing}", "--input", "{input}", "--output", "{out}",
      "--prompt-column", "text"], "tokenmill backfill: --model: model folder not found"),
    (["backfill", "--engine", "local", "--model", "{model}", "--input", "{missing}", "--output", "{out}",
      "--prompt-column", "text"], "tokenmill backfill: --input {missing}: no such file"),
    (["demo", "--model", "{missing}"], "tokenmill demo: --model: model folder not found"),
])
def test_each_model_command_refuses_a_bad_model_or_file_with_exit_2(command, expected, tmp_path, tiny_llama_dir,
                                                                    capsys):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    names = {"missing": str(tmp_path / "missing"), "file": str(tmp_path / "a-file"), "model": str(tiny_llama_dir),
             "input": str(tmp_path / "in.jsonl"), "out": str(tmp_path / "out.jsonl")}
    argv = [arg.format(**names) for arg in command]
    assert main(argv) == 2
    assert expected.format(**names) in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_the_broker_check_tells_a_listening_broker_from_a_closed_port():
    from tokenmill.kafka.local_broker import free_port

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert preflight.broker(f"127.0.0.1:{free_port()},127.0.0.1:{port}") == []
    closed = free_port()
    [problem] = preflight.broker(f"127.0.0.1:{closed}")
    assert problem.startswith(f"--bootstrap-servers: no broker answers at 127.0.0.1:{closed} (")
    assert preflight.broker("no-port-here") == ["--bootstrap-servers no-port-here: expected HOST:PORT"]


def test_an_s3_model_is_checked_with_one_listing(s3_bucket, tiny_llama_dir):
    import boto3

    client = boto3.client("s3")
    for path in tiny_llama_dir.iterdir():
        client.upload_file(str(path), s3_bucket, f"models/tiny/{path.name}")
    client.put_object(Bucket=s3_bucket, Key="models/no-weights/config.json", Body=(tiny_llama_dir / "config.json").read_bytes())
    client.put_object(Bucket=s3_bucket, Key="models/no-weights/tokenizer.json", Body=b"{}")
    assert preflight.remote_model(f"s3://{s3_bucket}/models/tiny/") == []
    assert preflight.remote_model(f"s3://{s3_bucket}/models/no-weights") == [
        f"--model: s3://{s3_bucket}/models/no-weights/ has no safetensors weights"]
    assert preflight.remote_model(f"s3://{s3_bucket}/models/none/") == [
        f"--model: s3://{s3_bucket}/models/none/: no objects under this prefix"]
    assert preflight.model(f"s3://{s3_bucket}/models/tiny/") == []  # the local phase leaves it to the round trip


def test_an_unreachable_s3_endpoint_fails_within_seconds(monkeypatch):
    from tokenmill.kafka.local_broker import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    t0 = time.perf_counter()
    [problem] = preflight.remote_model("s3://bucket/models/tiny/")
    assert problem.startswith("--model: cannot read s3://bucket/models/tiny/: ")
    assert time.perf_counter() - t0 < 10
