"""Compile constraints off the engine step: a thread pool, a cache, a time limit.

A request's constraint is submitted when it enters the engine; the request waits outside the
running batch until its compile is done, so a slow compile never holds other rows. Compiles are
cached by StructuredOutputsParams.key, successes and failures alike: 256 rows over 8 schemas
compile 8 times, and a bad schema sent a million times fails a million times without a compile.

The time limit is measured from submission: a compile not done by then fails its requests, and
the key is remembered as failed (the thread cannot be stopped, it finishes and is ignored).
llguidance's own limits (lexer fuel, grammar size) end most pathological constraints well before.
Compiles run on daemon threads, at most `threads` at a time: a compile that never ends holds
one slot, and never the engine's step or the process's exit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.structured.backend import ConstraintBackend, ConstraintError
from tokenmill.engine.types import StructuredOutputsParams

# Distinct constraints kept (compiled grammars are small; a backfill uses a handful).
CACHE_ENTRIES = 512


@dataclass
class CompileEntry:
    """One key's compile: running, done (grammar) or failed (reason)."""

    future: Future
    submitted: float  # time.monotonic() of the first submission
    failure: str | None = None  # set once the compile failed or ran past the time limit
    ended: float | None = None  # time.monotonic() when the compile ended


@dataclass
class CompileOutcome:
    grammar: Any = None
    error: str | None = None


@dataclass
class ConstraintCompiler:
    backend: ConstraintBackend
    timeout_s: float = 5.0
    threads: int = 2
    on_compile: Callable[[float], None] = lambda seconds: None  # told the seconds of each compile that ran

    def __post_init__(self) -> None:
        self._slots = threading.Semaphore(self.threads)
        self._cache: OrderedDict[tuple, CompileEntry] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> CompileEntry:
        """The compile of `params`, started now or found in the cache."""
        key = params.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
            entry = CompileEntry(Future(), time.monotonic())
            threading.Thread(target=self._run, args=(params, entry), name="constraint-compile",
                             daemon=True).start()
            self._cache[key] = entry
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return entry

    def _run(self, params: StructuredOutputsParams, entry: CompileEntry) -> None:
        with self._slots:
            t0 = time.perf_counter()
            grammar = error = None
            try:
                grammar = self.backend.compile(params)
            except BaseException as exc:  # the reason goes to the requests; nothing escapes a thread
                error = exc
            self.on_compile(time.perf_counter() - t0)  # before the outcome: counted when it is seen
            entry.ended = time.monotonic()
            if error is not None:
                entry.future.set_exception(error)
            else:
                entry.future.set_result(grammar)

    def outcome(self, entry: CompileEntry, now: float | None = None) -> CompileOutcome | None:
        """The grammar or the failure of a compile; None while it runs within its time limit."""
        if entry.failure is not None:
            return CompileOutcome(error=entry.failure)
        done = entry.future.done()
        if done and entry.future.exception() is not None:  # the library's own reason, however late
            exc = entry.future.exception()
            entry.failure = str(exc) if isinstance(exc, ConstraintError) else f"the constraint failed to compile: {exc!r}"
            return CompileOutcome(error=entry.failure)
        # A compile that ended past the limit fails too, even when first looked at afterwards.
        end = entry.ended if done else (time.monotonic() if now is None else now)
        if end - entry.submitted >= self.timeout_s:
            entry.failure = f"compiling the constraint took longer than the {self.timeout_s:g} s limit"
            return CompileOutcome(error=entry.failure)
        return CompileOutcome(grammar=entry.future.result()) if done else None

    def wait_any(self, entries: list[CompileEntry], timeout_s: float) -> None:
        """Block until one of the running compiles ends or `timeout_s` passes (an idle engine's wait)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        running = [e.future for e in entries if e.failure is None and not e.future.done()]
        if running:
            wait(running, timeout=timeout_s, return_when=FIRST_COMPLETED)

