"""Starting jobs in the engine: the crash attempt is written ahead, and a suspect runs alone.

This step sits between inflight.py and the engine thread and has the engine thread's `submit` /
`abort`, so in-flight jobs do not know it is there. For each job handed to it (see attempts.py
for the counts):

1. It waits in fetch order. A job whose count is at least `solo_from` is a suspect: it may be the
   one that killed the workers before. A suspect waits until no other job of this worker is in
   the engine, then runs alone; nothing else starts until it ends. A job of a `crowded`
   partition (its counts near the metadata budget) waits while others run. A job of a revoked
   partition (rebalance.py: its work is kept until the new assignment) goes to the engine at
   once, counted but without waiting for a commit, which cannot be made for it now; its count
   goes with the first commit after the partition comes back (a worker that dies in between
   misses that one count). A suspect of a revoked partition waits for it to come back.
2. Its count goes up by one (`begin`) and the commit loop is woken.
3. Once a commit carrying that count has succeeded (`after_commit`), the job goes to the engine.
4. Its final delta (`take`) or an abort ends the attempt: the count is back to what it was.

So a crash while a suspect runs counts against that job only, and a job is dead-lettered
(intake.py, at `--max-crash-attempts`) only after its last attempt ran alone and the worker died.

`solo_from` is max(1, max_attempts - 1): with the default of 3, jobs run alone from their third
attempt on. The attempts before it run with other jobs, as usual: most hard deaths (a node
lost, an eviction, an out-of-memory kill caused by the whole load) are no job's fault, and the
next owner should not run every job that was in flight one at a time. A job that killed the
worker twice while others ran with it then gets its third run alone, and its neighbours, which
may have been counted twice too, run alone as well before they could be counted a third time.

The cost: every start waits for one offset commit (jobs that arrive together share it), and
while a suspect runs the engine runs nothing else. With `max_attempts` 0 the step is a plain
pass-through: no counting, no waiting, no dead-lettering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import TopicPartition
from structlog.typing import FilteringBoundLogger

from tokenmill.engine.types import EngineRequest, RequestDelta
from tokenmill.kafka.offsets import OffsetTracker, PartitionOffsets
from tokenmill.kafka.types import Fetched, InFlightJob
from tokenmill.runtime.engine_thread import EngineThread


@dataclass(eq=False)
class _Start:
    request: EngineRequest
    every_delta: bool
    fetched: Fetched
    solo: bool  # a suspect: runs with nothing else in the engine
    version: int = 0  # the counts' version that must be committed before it goes to the engine
    counted: bool = False  # ended by a failure of the engine: the attempt stays counted


class StartGate:
    def __init__(self, engine_thread: EngineThread, tracker: OffsetTracker[TopicPartition], max_attempts: int,
                 wake_commit: Callable[[], None], log: FilteringBoundLogger) -> None:
        self.engine_thread = engine_thread
        self.tracker = tracker
        self.enabled = max_attempts > 0
        self.solo_from = max(1, max_attempts - 1)
        self.wake_commit = wake_commit  # the commit loop commits at once
        self.log = log
        self.lookup: Callable[[str], InFlightJob | None] = lambda request_id: None  # set by the wiring
        self._waiting: dict[str, _Start] = {}  # in fetch order: not counted yet
        self._begun: dict[str, _Start] = {}  # counted, waiting for the commit that carries the count
        self._running: dict[str, _Start] = {}  # in the engine
        self._solo: str | None = None  # the suspect that has begun or runs
        self.solo_runs = 0  # suspects started alone, this process

    @property
    def alive(self) -> bool:
        return self.engine_thread.alive

    @property
    def held(self) -> int:
        """Jobs handed over that are not in the engine yet (for backpressure, like waiting ones)."""
        return len(self._waiting) + len(self._begun)

    # -- the engine thread's interface, for inflight.py -----------------------------------------
    def submit(self, request: EngineRequest, every_delta: bool = False) -> None:
        if not self.enabled:
            self.engine_thread.submit(request, every_delta=every_delta)
            return
        job = self.lookup(request.request_id)
        part = self._part(job.fetched) if job is not None else None
        if job is None or part is None:
            return  # its partition is gone: the job is abandoned, or is about to be
        solo = part.attempts.count(job.fetched.offset) >= self.solo_from
        self._waiting[request.request_id] = _Start(request, every_delta, job.fetched, solo)
        self._pump()

    def abort(self, request_id: str) -> bool:
        """A graceful end (revoked, drained, lost): the attempt does not count. True when the job
        was in the engine (its last delta will come back, ABORTED)."""
        if not self.enabled:
            self.engine_thread.abort(request_id)
            return True
        if self._waiting.pop(request_id, None) is not None:
            return False
        in_engine = False
        start = self._begun.pop(request_id, None)
        if start is None:
            start = self._running.pop(request_id, None)
            if start is None:
                return False
            self.engine_thread.abort(request_id)
            in_engine = True
            if not self.engine_thread.alive:  # the engine failed with the job in it: that counts
                start.counted = True
        self._ended(request_id, start)
        self._pump()
        return in_engine

    # -- reports ----------------------------------------------------------------------------------
    def take(self, deltas: list[RequestDelta]) -> None:
        """A step's deltas: each finished request's attempt ended cleanly."""
        ended = False
        for delta in deltas:
            if delta.finished and (start := self._running.pop(delta.request_id, None)) is not None:
                self._ended(delta.request_id, start)
                ended = True
        if ended:
            self._pump()

    def after_commit(self) -> None:
        """A commit round is over: the jobs whose counts it carried go to the engine."""
        for request_id, start in list(self._begun.items()):
            part = self._part(start.fetched)
            if part is None:
                del self._begun[request_id]
                if self._solo == request_id:
                    self._solo = None
            elif part.attempts.committed_version >= start.version or (part.revoking and not start.solo):
                self._run(request_id)
        self._pump()

    def _run(self, request_id: str) -> None:
        start = self._begun.pop(request_id)
        self._running[request_id] = start
        self.engine_thread.submit(start.request, every_delta=start.every_delta)

    # -- inside ---------------------------------------------------------------------------------
    def _part(self, fetched: Fetched) -> PartitionOffsets | None:
        return self.tracker.get(fetched.tp, fetched.epoch)

    def _ended(self, request_id: str, start: _Start) -> None:
        part = self._part(start.fetched)
        if part is not None and not start.counted:
            part.attempts.end(start.fetched.offset)
        if self._solo == request_id:
            self._solo = None

    def _pump(self) -> None:
        """Begin what may begin now, in fetch order (rule 1 of the module docstring)."""
        if self._solo is not None:
            return
        begun = False
        for request_id, start in list(self._waiting.items()):
            part = self._part(start.fetched)
            if part is None:
                del self._waiting[request_id]
                continue
            busy = bool(self._begun or self._running)
            if part.revoking:  # no commit can carry its count now: it runs, the count goes with the next one
                if start.solo:
                    break  # a suspect waits for the partition to come back, and nothing after it starts
                self._begin(request_id, start, part)
                self._run(request_id)
                continue
            if start.solo:
                if not busy:
                    self._begin(request_id, start, part)
                    self._solo = request_id
                    self.solo_runs += 1
                    f = start.fetched
                    self.log.info("a job that was in flight when workers died runs alone", partition=f.tp.partition,
                                  offset=f.offset, attempt=part.attempts.count(f.offset))
                    begun = True
                break  # nothing after a suspect starts before it
            if part.attempts.crowded and busy:
                continue
            self._begin(request_id, start, part)
            begun = True
        if begun:
            self.wake_commit()

    def _begin(self, request_id: str, start: _Start, part: PartitionOffsets) -> None:
        del self._waiting[request_id]
        start.version = part.attempts.begin(start.fetched.offset)
        self._begun[request_id] = start
