"""Test only: `tokenmill worker` whose engine kills its own process whenever a chosen job runs.

    python -m tests.killing_worker RAN_FILE PROMPT worker --bootstrap-servers ... (the worker's flags)

The engine is patched before the worker's command line runs: after any step that had a request
with prompt PROMPT in it, one line is appended (and synced) to RAN_FILE and the process sends
itself SIGKILL, as the OOM killer or a native crash would end it: no drain, no commit, nothing
in Python's shutdown. A test counts the runs from RAN_FILE.
"""

from __future__ import annotations

import os
import signal
import sys


def install(ran_file: str, prompt: str) -> None:
    from tokenmill.engine.engine import Engine

    real_add, real_step = Engine.add, Engine.step
    doomed: set[str] = set()

    def add(self, request):
        real_add(self, request)
        if request.prompt == prompt:
            doomed.add(request.request_id)

    def step(self):
        deltas = real_step(self)
        if doomed:
            with open(ran_file, "a") as f:
                f.write(f"{os.getpid()} {' '.join(sorted(doomed))}\n")
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return deltas

    Engine.add, Engine.step = add, step


def main(argv: list[str]) -> int:
    ran_file, prompt, *worker_argv = argv
    install(ran_file, prompt)
    from tokenmill.cli import main as tokenmill

    return tokenmill(worker_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
