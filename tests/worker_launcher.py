"""Test only: starts worker processes by forking a launcher that has already imported the worker's
third-party libraries.

Why: a `tokenmill worker` start spends about 2.5 CPU-s on 2 cores importing torch and its other
libraries, more than half of a start, and the Kafka tests start about fifty workers, killed and
started again. A forked child is still a process of its own: its own pid and session, its own
environment, working directory and log, killed with SIGKILL and started again like any other. It
runs the same module a fresh `python -m MODULE ARGS` would, imports every tokenmill module itself
after the fork, with its own environment, and leaves through the interpreter's normal shutdown.
What it shares with the launcher is only the third-party modules in PRELOAD, imported before the
fork and never used there (no tensor made, no thread started, nothing read from the environment
but what LOAD_TIME_ENV names).

Libraries read some variables once, when they load (OpenMP's, malloc's, Python's own): each
environment that differs in those gets a launcher of its own, up to MAX_LAUNCHERS per test process;
past that, a start runs in a fresh interpreter. The tests of the command itself (its start, its
wheel) run fresh interpreters anyway.

    python -m tests.worker_launcher FD      (the launcher, serving the socket FD; see Launcher)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Imported by every worker before its engine is ready; none reads the environment at import but
# through the variables LOAD_TIME_ENV names.
PRELOAD = ("torch", "numpy", "safetensors", "tokenizers", "aiokafka", "pydantic", "structlog",
           "prometheus_client", "tqdm", "jinja2")

# Variables read when a library or the interpreter loads, not when they are used.
LOAD_TIME_ENV = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "MALLOC_", "GLIBC_TUNABLES",
                 "LD_", "PYTHON", "TORCH", "CUDA", "NVIDIA", "ATEN_")

_MESSAGE_MAX = 1 << 20


def _load_time(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_ENV)}


# -- the launcher process ----------------------------------------------------------------------------
def serve(fd: int) -> None:
    """Fork a child per request until the socket closes; report each child's start and exit."""
    for name in PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=fd)
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        _report_exits(sock)
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, _MESSAGE_MAX, 1)
        if not message:
            return  # the test process has gone
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(request, fds[0])  # raises SystemExit in the child, ending it the normal way
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"started": pid}).encode())


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become(request: dict, log_fd: int) -> None:
    """In the forked child: what `python -m MODULE ARGS` with this environment, working directory
    and output would have been."""
    import runpy

    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


# -- the test process's side ----------------------------------------------------------------------
class ForkedProcess:
    """The parts of subprocess.Popen the tests use, for a child of the launcher."""

    def __init__(self, launcher: Launcher, pid: int, args: Sequence[str]) -> None:
        self._launcher = launcher
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._launcher.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Popen's rule: no signal to a process known to have ended (its pid may be another's now).
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """A launcher process for one load-time environment, started on first use, gone when the test
    process is."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.NamedTemporaryFile(prefix="tokenmill-worker-launcher-", suffix=".log", delete=False)
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.worker_launcher", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], cwd=REPO, env=dict(env), stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT)
        theirs.close()
        atexit.register(self._close)
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._ready = False
        self._gone = False
        threading.Thread(target=self._read, name="worker-launcher", daemon=True).start()

    def alive(self) -> bool:
        return not self._gone and self._proc.poll() is None

    def start(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: Path, log_fd: int,
              timeout: float = 180) -> int:
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        with self._send_lock:
            with self._changed:
                if not self._changed.wait_for(lambda: self._ready or self._gone, timeout):
                    raise RuntimeError(f"the worker launcher did not get ready in {timeout} s ({self._log.name})")
            socket.send_fds(self._sock, [json.dumps(request).encode()], [log_fd])
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._gone, timeout):
                    raise RuntimeError(f"the worker launcher did not start {module} ({self._log.name})")
                if self._gone:
                    raise RuntimeError(f"the worker launcher has gone: {Path(self._log.name).read_text()[-2000:]}")
                return self._started.pop(0)

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code, None while it runs. Raises once the launcher has gone without
        reporting it: the child's state is unknown from then on, and a signal sent to its pid could
        reach another process that has the number now."""
        with self._changed:
            return self._known_exit(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout)
            return self._known_exit(pid)

    def _known_exit(self, pid: int) -> int | None:
        if pid not in self._exits and self._gone:
            raise RuntimeError(f"the worker launcher has gone: {Path(self._log.name).read_text()[-2000:]}")
        return self._exits.get(pid)

    def _close(self) -> None:
        """At the test process's exit: the launcher ends when its socket closes; its log goes."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the launcher reads the end
        self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        Path(self._log.name).unlink(missing_ok=True)

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(_MESSAGE_MAX)
            except OSError:
                message = b""
            with self._changed:
                if not message:
                    self._gone = True
                    self._changed.notify_all()
                    return
                event = json.loads(message)
                if "ready" in event:
                    self._ready = True
                elif "started" in event:
                    self._started.append(event["started"])
                else:
                    self._exits[event["exited"]] = event["code"]
                self._changed.notify_all()


# One launcher per environment as libraries read it when they load; a test process that needs more
# (a test asking for other threads, a variable some library set) starts the rest fresh.
MAX_LAUNCHERS = 3
_launchers: dict[tuple[tuple[str, str], ...], Launcher] = {}
_launchers_lock = threading.Lock()


def start_process(cmd: Sequence[str], env: Mapping[str, str], log_path: Path, fresh_interpreter: bool = False):
    """Start `cmd` in a session of its own, in the repository, its output appended to log_path;
    returns a ForkedProcess for `python -m MODULE ARGS` (from the launcher of its environment as
    libraries read it when they load), else (another interpreter, fresh_interpreter, or
    MAX_LAUNCHERS environments already served) a subprocess.Popen."""
    with open(log_path, "ab") as log:
        if not fresh_interpreter and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
            launcher = _launcher_for(env)
            if launcher is not None:
                return ForkedProcess(launcher, launcher.start(cmd[2], cmd[3:], env, REPO, log.fileno()), cmd)
        return subprocess.Popen(list(cmd), cwd=REPO, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _launcher_for(env: Mapping[str, str]) -> Launcher | None:
    key = tuple(sorted(_load_time(env).items()))
    with _launchers_lock:
        launcher = _launchers.get(key)
        if launcher is not None and launcher.alive():
            return launcher
        if launcher is None and len(_launchers) >= MAX_LAUNCHERS:
            return None
        # A launcher that has gone is replaced; its children were reported up to its end.
        _launchers[key] = launcher = Launcher(env)
        return launcher


if __name__ == "__main__":
    serve(int(sys.argv[1]))
