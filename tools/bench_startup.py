"""How long a bench process took to become useful: `startup_s` and `first_result_s`, in every
workload's report and table.

- startup_s: from the process's own start (its start time as the kernel records it,
  /proc/self/stat, in 10 ms ticks) to the moment its first engine is ready (create_engine returned):
  the interpreter, the imports, the command line, the model's weights, the tokenizer and the KV
  cache, what a `tokenmill worker` or `run-batch` pays before its first step. Set-up that only the
  bench does before that engine (the kafka workload's throw-away broker) is left out.
- startup_cpu_s: the CPU seconds the process spent in that time (user and system, every thread):
  what the start itself cost, where startup_s on a shared machine also counts the time other
  processes held the cores.
- first_result_s: from that moment to the first request that engine finishes: its warm-up's first
  request (a 40-token prompt, 4 tokens out), alone, as a first job would be: the first step's
  lazily made kernels, plans and memory.

Both describe the process's first engine, so they mean what they say when the bench runs as a
command (`tokenmill bench`, one workload per process); a second run in the same process reports
its process's first engine again. On a system without /proc, startup_s is left out.
"""

from __future__ import annotations

import os
import resource
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)  # the clock /proc/self/stat's start time counts on


def _since_boot() -> float | None:
    return time.clock_gettime(_CLOCK) if _CLOCK is not None else None


def process_cpu_s() -> float:
    """CPU seconds this process has spent so far (user and system, all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_started_at() -> float | None:
    """This process's start, in seconds on the boot clock (None where /proc cannot tell)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces: split after it
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


class _StartupClock:
    """The process's first engine: when it was ready and when it finished its first request."""

    def __init__(self) -> None:
        self.ready_at: float | None = None  # perf_counter seconds
        self.startup_s: float | None = None
        self.startup_cpu_s: float | None = None
        self.first_result_s: float | None = None
        self.excluded_s = 0.0  # bench-only set-up before the first engine
        self.excluded_cpu_s = 0.0
        self._engine: weakref.ref | None = None

    def engine_ready(self, engine: Any) -> None:
        if self._engine is not None:
            return
        self.ready_at = time.perf_counter()
        self._engine = weakref.ref(engine)
        started, now = process_started_at(), _since_boot()
        if started is not None and now is not None:
            self.startup_s = max(0.0, now - started - self.excluded_s)
            self.startup_cpu_s = process_cpu_s() - self.excluded_cpu_s

    def is_first(self, engine: Any) -> bool:
        return self._engine is not None and self._engine() is engine and self.first_result_s is None


_clock = _StartupClock()


def new_engine(config: Any) -> Any:
    """create_engine(config) (the backend the config names); the process's first one is the one
    startup_s ends at."""
    from tokenmill.engine import create_engine
    from tokenmill.engine.heap import freeze_startup_heap

    engine = create_engine(config)
    _clock.engine_ready(engine)
    # As the worker does with its engine (engine/heap.py); run_bench thaws at the end of the run.
    freeze_startup_heap()
    return engine


def map_kv_cache(engine: Any) -> None:
    """Write every page of the engine's KV cache once, keeping its values (x 1.0), so its pages are
    mapped before anything is timed. The engine leaves the cache unwritten at start (its start time);
    a worker has touched all of it after its first few thousand requests. Until then each pass
    meets blocks never touched (the free list hands out fresh ones first), and a bench that compares
    two engines step for step counted those page faults against whichever side met them: pair
    figures of the same feature ranged from -8% to +15%. For the benches that compare engines in
    lockstep (structured, features)."""
    import torch

    with torch.inference_mode():
        for key, value in getattr(getattr(engine, "runner", None), "kv_caches", ()):
            key.mul_(1.0)
            value.mul_(1.0)


def warm_up(engine: Any, requests: Sequence[Any]) -> dict[str, Any]:
    """engine.generate(requests) as a warm-up; on the process's first engine the first request runs
    alone, and its finish is where first_result_s ends."""
    if not _clock.is_first(engine) or not requests:
        return engine.generate(requests)
    results = engine.generate(requests[:1])
    _clock.first_result_s = time.perf_counter() - _clock.ready_at
    results.update(engine.generate(requests[1:]))
    return results


@contextmanager
def excluded() -> Iterator[None]:
    """Bench-only set-up (a throw-away broker): its time is not part of startup_s."""
    t0, cpu0 = time.perf_counter(), process_cpu_s()
    try:
        yield
    finally:
        if _clock.ready_at is None:
            _clock.excluded_s += time.perf_counter() - t0
            _clock.excluded_cpu_s += process_cpu_s() - cpu0


def startup_fields() -> dict[str, float]:
    """startup_s, startup_cpu_s and first_result_s of the process's first engine, those that are known."""
    fields = {"startup_s": _clock.startup_s, "startup_cpu_s": _clock.startup_cpu_s,
              "first_result_s": _clock.first_result_s}
    return {k: round(v, 3) for k, v in fields.items() if v is not None}


def startup_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows for the report's startup_s (with startup_cpu_s) and first_result_s."""
    rows = []
    if "startup_s" in report:
        rows.append(("startup", f"{report['startup_s']:.2f} s  (process start -> engine ready)"))
    if "startup_cpu_s" in report:
        rows.append(("startup CPU", f"{report['startup_cpu_s']:.2f} s  (the process's CPU time in it, all threads)"))
    if "first_result_s" in report:
        rows.append(("first result", f"{report['first_result_s']:.2f} s  (engine ready -> first request done)"))
    return rows
