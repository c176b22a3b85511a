"""tools/tiny_models.build_once: of processes that ask for the same cached directory at once (the
workers of a parallel test run on a fresh machine), one builds it and the others wait for it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tokenmill.tools.tiny_models import build_once

BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from tokenmill.tools.tiny_models import build_once

    target, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)  # long enough for the other processes to arrive while it builds
        (tmp / "weights").write_text("w")
        (tmp / "config.json").write_text("{}")

    built = build_once(target, build)
    print((built / "weights").read_text())
""")


def test_processes_asking_at_once_build_the_directory_once_and_all_get_it_whole(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(target), str(log)], stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["w\n"] * 3
    assert len(log.read_text().split()) == 1  # one build, whoever won
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "weights"]


def test_a_built_directory_is_returned_without_building_again(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{}")

    def build(tmp):
        raise AssertionError("built again")

    assert build_once(target, build) == target
