"""The test helper that forks worker processes from a launcher with torch imported
(tests/worker_launcher.py): each child is a process of its own, as `python -m` would have started
it; an environment that libraries read when they load gets a launcher of its own, past a few a
fresh interpreter."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import worker_launcher


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": str(worker_launcher.REPO), **extra}


def _probe(tmp_path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tests.launcher_probe", str(tmp_path / "probe.json"), *args]


def _report(tmp_path) -> tuple[dict, list[str]]:
    first, *after = (tmp_path / "probe.json").read_text().splitlines()
    return json.loads(first), after


def test_a_forked_child_is_its_own_process_with_its_own_environment(tmp_path):
    log = tmp_path / "probe.log"
    proc = worker_launcher.start_process(_probe(tmp_path, "3"), _env(PROBE_VALUE="mine"), log)
    assert isinstance(proc, worker_launcher.ForkedProcess)
    assert proc.wait(60) == 3 == proc.returncode == proc.poll()
    seen, after = _report(tmp_path)
    assert seen["pid"] == proc.pid != os.getpid() and seen["sid"] == proc.pid  # a session of its own
    assert seen["cwd"] == str(worker_launcher.REPO) and seen["argv"] == [str(tmp_path / "probe.json"), "3"]
    assert seen["value"] == "mine" and seen["stdin"] == ""
    assert seen["torch_loaded"] and not seen["tokenmill_loaded"]  # preloaded: torch, not tokenmill
    assert after == ["atexit"]  # left through the interpreter's own shutdown
    assert log.read_text() == "probe output\n"


def test_a_forked_child_is_killed_and_waited_for_like_a_popen(tmp_path):
    proc = worker_launcher.start_process(_probe(tmp_path, "0", "60"), _env(), tmp_path / "probe.log")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    _, after = _report(tmp_path)
    assert after == []  # no exit handler ran
    proc.kill()  # an ended process is not signalled again (its pid may be another's by now)


def test_a_child_of_a_launcher_that_has_gone_is_not_taken_for_running(tmp_path):
    proc = worker_launcher.start_process(_probe(tmp_path, "0", "60"), _env(), tmp_path / "probe.log")
    try:
        assert proc.poll() is None
        proc._launcher._proc.kill()  # its exits can no longer be reported
        deadline = time.monotonic() + 30
        while proc._launcher.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="launcher has gone"):
            proc.poll()
        with pytest.raises(RuntimeError, match="launcher has gone"):
            proc.send_signal(signal.SIGTERM)
        with pytest.raises(RuntimeError, match="launcher has gone"):
            proc.wait(1)
        # The next start gets a new launcher.
        other = worker_launcher.start_process(_probe(tmp_path, "5"), _env(), tmp_path / "other.log")
        assert other._launcher is not proc._launcher and other.wait(60) == 5
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the orphan, still sleeping: the test knows it is its own


def test_an_environment_libraries_read_at_load_gets_its_own_launcher_or_a_fresh_interpreter(tmp_path, monkeypatch):
    default = worker_launcher.start_process(_probe(tmp_path, "0"), _env(), tmp_path / "probe.log")
    assert default.wait(60) == 0 and _report(tmp_path)[0]["torch_threads"] == 1
    # OpenMP reads OMP_NUM_THREADS when it loads, before torch's first use: a launcher of its own,
    # whose torch was loaded with it.
    two = worker_launcher.start_process(_probe(tmp_path, "0"), _env(OMP_NUM_THREADS="2"), tmp_path / "probe.log")
    assert isinstance(two, worker_launcher.ForkedProcess) and two._launcher is not default._launcher
    assert two.wait(60) == 0 and _report(tmp_path)[0]["torch_threads"] == 2
    # Past MAX_LAUNCHERS environments, and where asked, a fresh interpreter.
    monkeypatch.setattr(worker_launcher, "MAX_LAUNCHERS", len(worker_launcher._launchers))
    three = worker_launcher.start_process(_probe(tmp_path, "0"), _env(OMP_NUM_THREADS="3"), tmp_path / "probe.log")
    assert isinstance(three, subprocess.Popen) and three.wait(60) == 0
    assert not _report(tmp_path)[0]["torch_loaded"]
    asked = worker_launcher.start_process(_probe(tmp_path, "0"), _env(), tmp_path / "probe.log",
                                          fresh_interpreter=True)
    assert isinstance(asked, subprocess.Popen) and asked.wait(60) == 0


def test_many_quick_starts_report_each_exit_to_its_own_process(tmp_path):
    procs = []
    for code in range(6):
        (tmp_path / str(code)).mkdir()
        procs.append(worker_launcher.start_process(_probe(tmp_path / str(code), str(code)), _env(),
                                                   tmp_path / "probe.log"))
    t0 = time.monotonic()
    assert [p.wait(60) for p in procs] == list(range(6))
    assert len({p.pid for p in procs}) == 6
    assert time.monotonic() - t0 < 60
