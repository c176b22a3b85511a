"""Runs the engine's step loop in its own thread, fed and drained without blocking asyncio.

The Kafka side (asyncio) must never wait for a model step, or polls, heartbeats and publishing
stall; the engine must never wait for Kafka, or the accelerator idles. So requests go in through a
thread-safe queue, the thread steps the engine whenever it has work, and each step's deltas come
back to the event loop in one `loop.call_soon_threadsafe` call, together with fresh stats for
backpressure.

Every bit of Python the event loop runs competes with the engine thread for the interpreter lock,
so only the deltas the caller needs cross over: finished ones, and every delta of the requests
submitted with `every_delta=True` (streaming). The others go to the engine as final-only
(EngineRequest.final_only): it builds no token deltas for them, and decodes their text once, at
the end, when they have no stop strings. New tokens are counted from the engine's own tally.

A step that raises for some requests fails only those (the engine finds them, see
worker/engine/fault_isolation.py): their final deltas say ERROR / INTERNAL with the exception,
and the loop goes on. Only an exception the engine cannot pin on a request ends the thread,
through `on_fatal` (the worker stops). EngineDied, from a step or from adding a request (vLLM's
engine core died, or a step stopped answering: worker/engine/backends/), is such an exception
wherever it comes from: no request is answered for it, the worker stops and its jobs go to another.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

from tokenmill.engine.backends.errors import EngineDied
from tokenmill.engine.types import EngineRequest, EngineStats, ErrorKind, FinishReason, RequestDelta, Usage

StepCallback = Callable[[list[RequestDelta], EngineStats, int], None]  # deltas, stats, new tokens
FatalCallback = Callable[[BaseException, str], None]

_ADD, _ABORT = "add", "abort"


class EngineThread:
    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        on_step: StepCallback,
        on_fatal: FatalCallback,
        idle_stats_interval_s: float = 0.25,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_step = on_step
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._every_delta: set[str] = set()  # touched by the engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_stats_interval_s = idle_stats_interval_s
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.step_seconds = 0.0
        self._tokens_counted = engine.stats().generated_tokens_total  # output tokens counted so far

    # -- called from the event loop -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineRequest, every_delta: bool = False) -> None:
        """Queue a request; with every_delta, each of its deltas is handed back, not just the last
        (without, the engine builds only the last: the request goes in as final_only)."""
        if request.final_only == every_delta:
            request = replace(request, final_only=not every_delta)
        self._commands.put((_ADD, (request, every_delta)))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put((_ABORT, request_id))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_streaming(self) -> int:
        """Requests in the engine whose every delta is handed back (0 once they all finished)."""
        return len(self._every_delta)

    # -- the engine thread ----------------------------------------------------------------------
    def _post(self, deltas: list[RequestDelta], count_tokens: bool = False) -> None:
        """Hand deltas and fresh stats to the loop; with count_tokens, also the output tokens the
        engine took in since the last count (final-only requests' tokens have no deltas)."""
        stats = self.engine.stats(drain_observations=True)
        new_tokens = 0
        if count_tokens:
            new_tokens = max(0, stats.generated_tokens_total - self._tokens_counted)
            self._tokens_counted = stats.generated_tokens_total
        try:
            self._loop.call_soon_threadsafe(self._on_step, deltas, stats, new_tokens)
        except RuntimeError:  # the loop is closed: we are shutting down
            self._stop.set()

    def _drain_commands(self) -> list[RequestDelta]:
        failed: list[RequestDelta] = []
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return failed
            if kind == _ADD:
                request, every_delta = payload  # type: ignore[misc]
                try:
                    self.engine.add(request)
                    if every_delta:
                        self._every_delta.add(request.request_id)
                except EngineDied:
                    raise  # the engine's end, not this request's: the thread ends, the worker stops
                except Exception as exc:  # a request the engine refuses must not stop the loop
                    # ValueError is the engine's "this request is invalid" (e.g. token ids outside
                    # the vocabulary); anything else is our failure, not the job's.
                    invalid = isinstance(exc, ValueError)
                    failed.append(
                        RequestDelta(
                            request_id=request.request_id,
                            new_token_ids=[],
                            text_delta="",
                            finished=True,
                            finish_reason=FinishReason.ERROR,
                            error_kind=ErrorKind.INVALID_REQUEST if invalid else ErrorKind.INTERNAL,
                            error=str(exc) if invalid else f"{type(exc).__name__}: {exc}",
                            usage=Usage(),
                        )
                    )
            else:
                try:
                    self.engine.abort(payload)
                except KeyError:
                    pass  # already finished

    def _run(self) -> None:
        last_post = 0.0
        try:
            while not self._stop.is_set():
                self._wake.clear()
                failed = self._drain_commands()
                if self.engine.has_work():
                    t0 = time.perf_counter()
                    deltas = self.engine.step()
                    self.step_seconds += time.perf_counter() - t0
                    self.steps += 1
                    wanted, every = list(failed), self._every_delta
                    for d in deltas:
                        if d.finished:
                            every.discard(d.request_id)
                            wanted.append(d)
                        elif d.request_id in every:
                            wanted.append(d)
                    self._post(wanted, count_tokens=True)
                    last_post = time.monotonic()
                    continue
                if failed or time.monotonic() - last_post >= self._idle_stats_interval_s:
                    self._post(failed)
                    last_post = time.monotonic()
                self._wake.wait(self._idle_stats_interval_s)
        except BaseException as exc:  # an engine crash is fatal for the worker, say so loudly
            detail = traceback.format_exc()
            try:
                self._loop.call_soon_threadsafe(self._on_fatal, exc, detail)
            except RuntimeError:
                pass
