"""A step that never returns must not leave a hung worker: vLLM's steps run on a thread of their own,
watched.

vLLM's engine core can stop answering without raising: with the core in a child process, a killed
core leaves ``LLMEngine.step()`` blocked on its output queue (only the next ``add_request`` raises
EngineDeadError); a stuck collective of tensor-parallel workers blocks a step for as long. So the
caller's step hands the call to the ``vllm-step`` thread and waits, checking every
``poll_s`` whether vLLM says the core is dead (``is_dead``), up to ``timeout_s`` in all. Either way
it raises EngineDied: the engine thread ends, the worker stops (exit code 1) and the group hands its
jobs to another member, where crash counting applies as after any crash.

The blocked call cannot be taken back. The thread is a daemon, so the interpreter can exit past
it, and a second timer makes sure the process does: should the orderly shutdown itself hang (a
lock the blocked step holds, an exit handler of vLLM's waiting for its core), the process ends
``exit_grace_s`` after the step was given up, with ``os._exit`` (None: no timer, for callers that
own their process's end themselves).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tokenmill.engine.backends.errors import EngineDied

log = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_CODE_HUNG = 1  # the worker's EXIT_FATAL: the process failed, its jobs go to another member


class StepWatchdog:
    """Runs calls on one thread of its own, watched. Every call that computes (vLLM's construction
    and its steps) must run on that one thread: OpenMP's thread count, which vLLM's CPU attention
    plans its work by, belongs to the thread that set it."""

    def __init__(self, timeout_s: float, is_dead: Callable[[], bool] = lambda: False, poll_s: float = 1.0,
                 exit_grace_s: float | None = 60.0, name: str = "vllm-step") -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.exit_grace_s = exit_grace_s
        self.is_dead = is_dead  # may be replaced once the engine exists
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)

    def run(self, fn: Callable[[], T], *, limit_s: float | None = -1.0) -> T:
        """fn() on the watched thread; its result or its exception. EngineDied when the engine is
        dead, or fn has not returned within the limit (timeout_s unless given; None: no limit), and
        from then on for every call."""
        if self._broken is not None:
            raise EngineDied(self._broken)
        limit = self.timeout_s if limit_s == -1.0 else limit_s
        future: Future = Future()
        self._calls.put((fn, future))
        started = time.monotonic()
        while True:
            try:
                return future.result(timeout=self.poll_s)
            except TimeoutError:
                pass
            waited = time.monotonic() - started
            if self.is_dead():
                self._give_up(f"vLLM's engine core died ({waited:.0f} s into a step)")
            if limit is not None and waited >= limit:
                self._give_up(f"a vLLM step has not returned in {waited:.0f} s (limit {self.timeout_s:g} s)")

    def _give_up(self, reason: str) -> None:
        self._broken = reason
        log.error("%s; the engine is given up and the process will exit", reason)
        if self.exit_grace_s is not None:
            threading.Thread(target=self._exit_later, args=(self.exit_grace_s,), name="vllm-exit-timer",
                             daemon=True).start()
        raise EngineDied(reason)

    @staticmethod
    def _exit_later(grace_s: float) -> None:
        time.sleep(grace_s)
        log.error("the process did not exit within %.0f s of giving the engine up: exiting now", grace_s)
        os._exit(EXIT_CODE_HUNG)

    @property
    def on_its_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Let the thread end once it is idle."""
        self._calls.put(None)
