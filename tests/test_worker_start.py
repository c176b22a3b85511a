"""A worker loads its model while its clients connect: started before its broker, it waits for both
at once; a load that fails ends the wait for the broker at once."""

import datetime
import json
import shutil
import time
from types import SimpleNamespace

import pytest

from tests.worker_helpers import start_worker_process, stop_process, worker_command
from tokenmill.kafka.local_broker import free_port

NO_TOPICS = SimpleNamespace(flags=lambda: [])


def _events(log_path) -> list[dict]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _at(event: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(event["timestamp"])


@pytest.mark.slow
def test_the_model_loads_while_the_worker_waits_for_its_broker(tiny_llama_dir, tmp_path):
    log = tmp_path / "worker.log"
    proc = start_worker_process(worker_command(f"127.0.0.1:{free_port()}", NO_TOPICS, tiny_llama_dir,
                                               "--broker-wait-timeout", "8", "--log-level", "INFO"), log)
    try:
        code = proc.wait(180)
    finally:
        stop_process(proc)
    events = _events(log)
    assert code == 5, log.read_text(errors="replace")[-3000:]
    waits = [e for e in events if e["event"] == "no broker reachable yet; waiting"]
    [loaded] = [e for e in events if e["event"] == "model loaded"]
    assert waits and _at(waits[0]) < _at(loaded), "the model loaded before the first try to connect"


@pytest.mark.slow
def test_a_model_that_fails_to_load_ends_the_wait_for_the_broker(tiny_llama_dir, tmp_path):
    model = tmp_path / "corrupt-model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file at all")  # passes the file-name check
    log = tmp_path / "worker.log"
    t0 = time.monotonic()
    proc = start_worker_process(worker_command(f"127.0.0.1:{free_port()}", NO_TOPICS, model,
                                               "--broker-wait-timeout", "300", "--log-level", "INFO"), log)
    try:
        code = proc.wait(180)
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    assert time.monotonic() - t0 < 120, "waited on for the broker after the load failed"
    assert "cannot read" in text and "model.safetensors" in text
