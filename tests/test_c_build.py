"""OnDemandLibrary: built once per process whichever thread asks first, then read without the lock."""

import threading

from tokenmill.engine import c_build


def test_many_threads_asking_at_once_build_once_and_share_the_answer(monkeypatch):
    built, declared = [], []
    gate = threading.Event()

    def slow_build(name, source, what):
        gate.wait(5)  # every thread is inside get() before the build finishes
        built.append(name)
        return f"lib:{name}"

    monkeypatch.setattr(c_build, "build_library", slow_build)
    lib = c_build.OnDemandLibrary("once", "int x;", "test", declared.append)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(lib.get())) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert answers == ["lib:once"] * 8
    assert built == ["once"] and declared == ["lib:once"]
    assert lib.get() == "lib:once" and built == ["once"]  # the settled answer, no second build


def test_a_failed_build_is_settled_as_none_and_not_retried(monkeypatch):
    calls = []

    def failing_build(name, source, what):
        calls.append(name)
        return None

    monkeypatch.setattr(c_build, "build_library", failing_build)
    lib = c_build.OnDemandLibrary("never", "int x;", "test", lambda lib: None)
    assert lib.get() is None and lib.get() is None
    assert calls == ["never"]
