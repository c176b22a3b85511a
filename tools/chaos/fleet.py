"""Worker processes of a chaos run: started, probed, stopped with SIGTERM or killed with SIGKILL.

Each worker is a real `tokenmill worker` process with its own metrics port and log file, so a
kill is a real process exit. What a departing worker still had uncommitted is read from its
`tokenmill_uncommitted_offsets` gauge just before the signal: fetching is the only step that
raises it, so the reading is never below the truth, and it bounds the Results another worker
can publish again for that worker's partitions. What a worker hands over in a rebalance or at the
end of a drain, it logs itself (`uncommitted` of the "partitions given up" and "drained" lines).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.kafka.local_broker import free_port
from tokenmill.tools.chaos import DEFAULT_WORKER_ARGS

_REPO = Path(__file__).resolve().parents[2]


@dataclass
class Costs:
    """A worker's running totals of what rebalances and stops cost it, read from its /metrics."""

    idle_s: float = 0.0  # tokenmill_engine_idle_seconds_total
    discarded: dict[int, float] = field(default_factory=dict)  # partition -> tokenmill_discarded_tokens_total
    output_tokens: float = 0.0  # tokenmill_output_tokens_total: tokens computed

    @classmethod
    def of(cls, samples: list[tuple[str, dict[str, str], float]]) -> Costs:
        costs = cls()
        for name, labels, value in samples:
            if name == "tokenmill_engine_idle_seconds_total":
                costs.idle_s = value
            elif name == "tokenmill_output_tokens_total":
                costs.output_tokens = value
            elif name == "tokenmill_discarded_tokens_total" and labels.get("partition", "").isdigit():
                p = int(labels["partition"])
                costs.discarded[p] = costs.discarded.get(p, 0.0) + value
        return costs

    def since(self, before: Costs) -> Costs:
        return Costs(self.idle_s - before.idle_s,
                     {p: v - before.discarded.get(p, 0.0) for p, v in self.discarded.items()
                      if v - before.discarded.get(p, 0.0) > 0},
                     self.output_tokens - before.output_tokens)

    @property
    def discarded_tokens(self) -> int:
        return int(sum(self.discarded.values()))


@dataclass
class Departure:
    worker: str
    how: str  # "SIGTERM" or "SIGKILL"
    at: float  # time.monotonic()
    uncommitted: int  # read just before the signal (0 if it could not be read)
    exit_code: int | None = None
    costs: Costs = field(default_factory=Costs)  # read just before the signal


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    started_at: float
    ready_at: float | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (name, labels, value) for every sample."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = {}
        for item in rest.rstrip("}").split(","):
            key, eq, val = item.partition("=")
            if eq:
                labels[key.strip()] = val.strip().strip('"')
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            continue
    return out


@dataclass
class Fleet:
    bootstrap: str
    topic_flags: list[str]
    model: str
    work_dir: Path
    worker_args: str = DEFAULT_WORKER_ARGS
    workers: dict[str, WorkerProc] = field(default_factory=dict)
    departures: list[Departure] = field(default_factory=list)
    unexpected_exits: list[tuple[str, int]] = field(default_factory=list)  # (worker, code)
    _count: int = 0

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "tokenmill.cli", "worker", "--bootstrap-servers", self.bootstrap,
                "--model", self.model, *self.topic_flags, *shlex.split(self.worker_args),
                "--metrics-port", str(port), "--log-level", "INFO"]

    def start(self, extra: tuple[str, ...] = ()) -> WorkerProc:
        self._count += 1
        name, port = f"w{self._count}", free_port()
        log_path = self.work_dir / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH")) if p))
        proc = start_process([*self.command(port), "--worker-name", name, *extra], env, log_path)
        w = WorkerProc(name, proc, port, log_path, time.monotonic())
        self.workers[name] = w
        return w

    def live(self) -> list[WorkerProc]:
        return [w for w in self.workers.values() if w.alive()]

    def check_exits(self) -> None:
        """Note every worker that exited without being told to (a worker must outlive any fault)."""
        told = {d.worker for d in self.departures}
        for w in self.workers.values():
            code = w.proc.poll()
            if code is not None and w.name not in told and (w.name, code) not in self.unexpected_exits:
                self.unexpected_exits.append((w.name, code))

    async def ready(self, w: WorkerProc) -> bool:
        status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{w.port}/readyz")
        return status == 200

    async def wait_ready(self, w: WorkerProc, timeout_s: float = 180.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not w.alive():
                raise RuntimeError(f"worker {w.name} exited with code {w.proc.returncode}:\n{self.log_tail(w)}")
            if await self.ready(w):
                w.ready_at = time.monotonic()
                return w.ready_at - w.started_at
            await asyncio.sleep(0.3)
        raise TimeoutError(f"worker {w.name} not ready within {timeout_s:g}s:\n{self.log_tail(w)}")

    async def metrics(self, w: WorkerProc) -> list[tuple[str, dict[str, str], float]]:
        status, text = await asyncio.to_thread(_get, f"http://127.0.0.1:{w.port}/metrics")
        return parse_metrics(text) if status == 200 else []

    async def costs(self, w: WorkerProc) -> Costs:
        return Costs.of(await self.metrics(w))

    def partitions_of(self, w: WorkerProc) -> set[int]:
        """The partitions the worker owns by its last "partitions assigned" log line."""
        events = [e for e in self.log_events("partitions assigned") if e.get("worker") == w.name]
        return set(events[-1]["partitions"]) if events else set()

    async def gauge(self, w: WorkerProc, name: str) -> float | None:
        for metric, _, value in await self.metrics(w):
            if metric == name:
                return value
        return None

    async def depart(self, w: WorkerProc, how: str = "SIGTERM", wait_s: float = 60.0) -> Departure:
        """Read what the worker has uncommitted, then signal it; SIGTERM waits for its drain."""
        samples = await self.metrics(w)
        uncommitted = next((v for name, _, v in samples if name == "tokenmill_uncommitted_offsets"), 0)
        sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM
        d = Departure(w.name, how, time.monotonic(), int(uncommitted or 0), costs=Costs.of(samples))
        self.departures.append(d)
        if w.alive():
            w.proc.send_signal(sig)
        d.exit_code = await asyncio.to_thread(_wait, w.proc, wait_s)
        return d

    async def stop_all(self, wait_s: float = 60.0) -> dict[str, int | None]:
        done = await asyncio.gather(*(self.depart(w, "SIGTERM", wait_s) for w in self.live()))
        return {d.worker: d.exit_code for d in done}

    def exits(self) -> dict[str, int | str | None]:
        """Every worker of the run, by name: "killed" for those the scenario killed, else the exit
        code (None: still running, or it had to be killed after not stopping in time)."""
        killed = {d.worker for d in self.departures if d.how == "SIGKILL"}
        return {name: "killed" if name in killed else w.proc.poll() for name, w in self.workers.items()}

    def kill_all_now(self) -> None:
        """The last resort of a failed run: nothing is left running."""
        for w in self.workers.values():
            if w.alive():
                w.proc.kill()
                _wait(w.proc, 10)

    def log_events(self, event: str) -> list[dict]:
        """Every JSON log line with this event, from every worker's log."""
        out = []
        for w in self.workers.values():
            try:
                lines = w.log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                if f'"event": "{event}"' not in line:
                    continue
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    @staticmethod
    def log_tail(w: WorkerProc, n: int = 3000) -> str:
        try:
            return w.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def start_process(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A worker process in a session of its own (a signal to the chaos run is not one to its
    workers), its output appended to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None
