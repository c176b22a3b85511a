"""The jobs between intake and answer: held (fair admission, tenants.py), or running in the engine thread.

One object owns a job's stay, so that every way out of it releases what the job held, in one
place: a job leaves when it finishes (`finish`), when its partition is revoked or the worker
stops (`abandon`: aborted in the engine), or when the engine refuses its sampling values at
submission (`on_refused`, which answers it as bad input). Whenever a job gives back its place,
tenants.py names the held job that takes it (the next tenant in turn, under its cap) and it is
submitted; a held job that was abandoned meanwhile passes the place on.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.job_mapping import job_to_engine_request
from tokenmill.kafka.tenants import TenantLimiter
from tokenmill.kafka.types import InFlightJob
from tokenmill.runtime.engine_thread import EngineThread


class InFlight:
    def __init__(self, tenants: TenantLimiter[InFlightJob], engine_thread: EngineThread,
                 on_refused: Callable[[InFlightJob, str], None]) -> None:
        self.tenants = tenants
        self.engine_thread = engine_thread
        self.on_refused = on_refused  # (job, reason): a job the engine refused, already forgotten here
        self._jobs: dict[str, InFlightJob] = {}  # request_id -> job, for everything not yet answered
        # request_id -> (input partition, why) of jobs aborted in the engine, until their last delta
        # says what was thrown away (engine_output.py counts it)
        self.aborted: dict[str, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, request_id: str) -> InFlightJob | None:
        return self._jobs.get(request_id)

    def admit(self, job: InFlightJob) -> None:
        """Take a job in; it runs now, or once its tenant is below the cap (in fetch order)."""
        self._jobs[job.request_id] = job
        if self.tenants.admit(job.job.tenant, job):
            self._submit(job)
        else:
            job.log.debug("tenant at its in-flight cap; held", tenant=job.job.tenant)

    def finish(self, job: InFlightJob) -> None:
        """The engine finished the job: forget it and free its tenant slot."""
        del self._jobs[job.request_id]
        self._release(job)

    def abandon(self, job: InFlightJob, reason: str = "rebalance") -> None:
        """Forget a job whose answer will not be published (its partition is gone or we stop)."""
        if self._jobs.pop(job.request_id, None) is not None and job.submitted:
            # starts.py answers False for a job it still held back (nothing reached the engine).
            if self.engine_thread.abort(job.request_id) is not False:
                self.aborted[job.request_id] = (job.fetched.tp.partition, reason)
            self._release(job)

    def abandon_where(self, predicate: Callable[[InFlightJob], bool], reason: str = "rebalance") -> int:
        """Abandon every job for which predicate(job) holds; returns how many. The held ones leave
        the tenant queue first, so a slot freed here never starts a job that is abandoned next."""
        self.tenants.drop_held(predicate)
        chosen = [job for job in self._jobs.values() if predicate(job)]
        for job in chosen:
            self.abandon(job, reason)
        return len(chosen)

    def _submit(self, job: InFlightJob) -> None:
        try:
            request = job_to_engine_request(job.job, request_id=job.request_id)
        except ValueError as exc:  # sampling values the engine refuses although the schema allowed them
            self._jobs.pop(job.request_id, None)
            self._release(job)
            self.on_refused(job, str(exc))
            return
        job.submitted = True
        self.engine_thread.submit(request, every_delta=job.job.stream)
        job.log.debug("submitted to engine", attempt=job.attempt)

    def _release(self, job: InFlightJob) -> None:
        nxt = self.tenants.release(job.job.tenant)
        if nxt is None:
            return
        if nxt.request_id in self._jobs:
            self._submit(nxt)
        else:  # abandoned while held: it passes the slot on
            self._release(nxt)
