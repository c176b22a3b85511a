"""Intake: one fetched record becomes a job for the engine, or is answered at once.

In this order:

1. Decode through the contract decoder (`schemas/`): not UTF-8, not JSON, a schema violation, a
   tombstone (no value), a value framed for a schema registry whose schema id is unknown or not
   a Job schema of this topic (registry.py) -> `invalid_job`; a `model` other than the served name ->
   `model_mismatch`. Such input is answered with a dead letter and, when a job_id can be read, an
   error Result (answers.rejected).
2. Every input is counted by the bad-input guard (good or bad); when most of the recent ones were
   bad, `on_guard_tripped` stops the worker (exit 3) instead of emptying the topic into the
   dead-letter topic.
3. A job that was in the engine each time a worker died, `max_crash_attempts` times
   (attempts.py: the counts come with the committed offset), is not run again: a dead letter
   and an error Result with code `crashed_worker`. It is valid input, so the guard counts it as
   good.
4. A `deadline_ms` already past: an `expired` Result, the job never reaches the engine.
5. Otherwise the job, with a fresh attempt id, goes to inflight.py, where the tenant cap lets it
   run now or holds it in fetch order.

A job the engine refuses at submission (sampling values the schema allowed but the engine does
not) comes back through `refuse` and is answered like other bad input.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from structlog.typing import FilteringBoundLogger

from tokenmill.job_mapping import new_attempt_id
from tokenmill.kafka import answers
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.guard import BadInputGuard, BadInputGuardTripped
from tokenmill.kafka.registry import JobReader
from tokenmill.kafka.types import Answer, Fetched, InFlightJob
from tokenmill.logging import job_log
from tokenmill.schemas.constants import ERROR_CRASHED_WORKER, ERROR_INVALID_JOB, ERROR_MODEL_MISMATCH
from tokenmill.schemas.decode import decode_job
from tokenmill.schemas.errors import JobDecodeError
from tokenmill.schemas.job import Job


@dataclass(eq=False)
class Intake:
    ctx: AnswerContext
    guard: BadInputGuard
    admit: Callable[[InFlightJob], None]  # the next step of a job that may run
    answer: Callable[[Answer], None]  # the next step of an input answered at once
    on_guard_tripped: Callable[[str], None]  # with the guard's message: the worker stops (exit 3)
    log: FilteringBoundLogger
    crash_attempts: Callable[[Fetched], int] = lambda fetched: 0  # the record's crash attempts so far
    max_crash_attempts: int = 0  # 0: never dead-letter for crashes
    reader: JobReader | None = None  # framed Jobs (a schema registry); None: plain JSON only

    def take(self, fetched: Fetched) -> None:
        attempt = new_attempt_id(self.ctx.worker)
        try:
            job = self._decode(fetched.value)
        except JobDecodeError as err:
            self.record(err.code)
            log = job_log(self.log, err.job_id, fetched.tp.partition, fetched.offset)
            log.warning("bad input; dead-lettering", code=err.code, reason=err.message)
            self.answer(answers.rejected(fetched, err.code, err.message, job_id=err.job_id, attempt=attempt,
                                         metadata=None, ctx=self.ctx, log=log))
            return
        self.record(None)
        log = job_log(self.log, job.job_id, fetched.tp.partition, fetched.offset)
        crashes = self.crash_attempts(fetched) if self.max_crash_attempts else 0
        if crashes >= self.max_crash_attempts > 0:
            message = (f"the job was in flight each time a worker died, {crashes} times "
                       f"(--max-crash-attempts {self.max_crash_attempts}); it is not run again")
            log.warning("job of death; dead-lettering", code=ERROR_CRASHED_WORKER, crash_attempts=crashes)
            self.answer(answers.rejected(fetched, ERROR_CRASHED_WORKER, message, job_id=job.job_id, attempt=attempt,
                                         metadata=job.metadata, ctx=self.ctx, log=log))
            return
        if job.deadline_ms is not None and job.deadline_ms <= time.time() * 1000:
            log.info("deadline passed before start; expired")
            self.answer(answers.expired(fetched, job, attempt=attempt, ctx=self.ctx, log=log))
            return
        self.admit(InFlightJob(fetched, job, attempt, log.bind(attempt=attempt)))

    def refuse(self, job: InFlightJob, reason: str) -> None:
        """A job the engine refused at submission: bad input after all."""
        self.record(ERROR_INVALID_JOB)
        self.answer(answers.rejected(job.fetched, ERROR_INVALID_JOB, reason, job_id=job.job.job_id,
                                     attempt=job.attempt, metadata=job.job.metadata, ctx=self.ctx, log=job.log))

    def record(self, code: str | None) -> None:
        """Count one input for the bad-input guard (code None: it was good)."""
        try:
            self.guard.record(code)
        except BadInputGuardTripped as exc:
            self.on_guard_tripped(str(exc))

    def _decode(self, value: bytes | None) -> Job:
        if value is None:
            raise JobDecodeError.invalid("the record has no value (a tombstone is not a job)")
        job = decode_job(self.reader.payload(value) if self.reader is not None else value)
        if job.model is not None and job.model != self.ctx.model:
            raise JobDecodeError(
                ERROR_MODEL_MISMATCH, f"job asks for model {job.model!r}; this worker serves {self.ctx.model!r}",
                job.job_id,
            )
        return job
