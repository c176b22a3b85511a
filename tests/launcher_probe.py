"""Test only: what a process started by tests/worker_launcher.py sees (test_worker_launcher.py).

    python -m tests.launcher_probe OUT EXIT_CODE [SLEEP_S]

Writes its pid, session, working directory, arguments, PROBE_VALUE, whether tokenmill or torch were
imported before it ran (and torch's thread count if so) to OUT as JSON, then an "atexit" line from an exit handler (so a
normal interpreter shutdown shows), after sleeping SLEEP_S seconds, and exits with EXIT_CODE.
"""

import atexit
import json
import os
import sys
import time

out, code, *rest = sys.argv[1:]
with open(out, "w") as f:
    f.write(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv[1:],
                        "value": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read(),
                        "tokenmill_loaded": any(m == "tokenmill" or m.startswith("tokenmill.") for m in sys.modules),
                        "torch_loaded": "torch" in sys.modules,
                        "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None})
            + "\n")
atexit.register(lambda: open(out, "a").write("atexit\n"))
print("probe output", flush=True)
if rest:
    time.sleep(float(rest[0]))
sys.exit(int(code))
