"""The offline driver: Jobs through an in-process Engine, one Result per job, no Kafka.

Shared by ``tokenmill run-batch`` (worker/batch_runner.py) and ``tokenmill backfill --engine
local`` (tools/backfill/local_backend.py), so a job runs the same way on both.

The caller adds jobs while the runner is not ``full`` and calls ``step()``; each step hands back
the Results of the jobs that finished in it, each with the tag the caller gave the job (a line,
a dataset row). At most ``max_in_flight`` requests sit in the engine at once: enough for the
scheduler to batch and to group shared prefixes, few enough that memory is bounded by the
window, not by the input.

Every job gets exactly one Result:
- the engine refuses the request (``add`` raises ValueError): ``add`` returns an error Result
  (``invalid_job``) at once and the job never enters the window;
- the request finishes: ``tokenmill.job_mapping.build_result`` of its final delta (ok, expired or
  error, with the code the delta's error kind maps to);
- an outcome the contract cannot express, or the engine idle with requests of ours still in it
  (which cannot happen; the runner never hangs on it): an error Result ``internal``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokenmill.job_mapping import build_result, error_result, job_to_engine_request, new_attempt_id
from tokenmill.schemas import ERROR_INTERNAL, ERROR_INVALID_JOB, Job, Result

Tag = TypeVar("Tag")


@dataclass
class _InFlight(Generic[Tag]):
    """One job inside the engine; its request id is its attempt id."""

    job: Job
    tag: Tag
    attempt: str


class OfflineRunner(Generic[Tag]):
    """Keeps at most ``max_in_flight`` jobs in ``engine`` and turns finished ones into Results.

    ``engine`` is used through its public API only (add, step, has_work, served_model_name,
    config); ``worker`` is the name written in Results and in attempt ids.
    """

    def __init__(self, engine: Any, *, worker: str, max_in_flight: int | None = None) -> None:
        self.engine = engine
        self.worker = worker
        self.max_in_flight = max_in_flight or 4 * engine.config.max_num_seqs
        self.model_name: str = engine.served_model_name
        self._in_flight: dict[str, _InFlight[Tag]] = {}  # request id (= attempt) -> job

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def full(self) -> bool:
        return len(self._in_flight) >= self.max_in_flight

    def add(self, job: Job, tag: Tag, attempt: str | None = None) -> Result | None:
        """Hand ``job`` to the engine. None: it is in the window and a later ``step()`` returns
        its Result. A Result: the engine refused it (invalid_job), and that is its answer."""
        attempt = attempt or new_attempt_id(self.worker)
        try:
            self.engine.add(job_to_engine_request(job, request_id=attempt))
        except ValueError as exc:  # values the engine refuses although the schema allowed them
            return self.error(job, ERROR_INVALID_JOB, str(exc), attempt)
        self._in_flight[attempt] = _InFlight(job, tag, attempt)
        return None

    def step(self) -> list[tuple[Tag, Result]]:
        """One engine step: (tag, Result) of every job of ours that finished in it."""
        if not self._in_flight:
            return []
        if not self.engine.has_work():  # cannot happen; never hang on it
            dropped, self._in_flight = list(self._in_flight.values()), {}
            return [(f.tag, self.error(f.job, ERROR_INTERNAL, "the engine dropped the request", f.attempt))
                    for f in dropped]
        done = []
        for delta in self.engine.step():
            if not delta.finished:
                continue
            f = self._in_flight.pop(delta.request_id, None)
            if f is None:
                continue
            try:
                result = build_result(f.job, delta, model=self.model_name, worker=self.worker, attempt=f.attempt)
            except ValueError as exc:  # an engine outcome the contract cannot express: say so
                result = self.error(f.job, ERROR_INTERNAL, str(exc), f.attempt)
            done.append((f.tag, result))
        return done

    def error(self, job: Job, code: str, message: str, attempt: str) -> Result:
        """An error Result for ``job`` under this runner's model and worker names."""
        return error_result(job.job_id, code, message, model=self.model_name, worker=self.worker,
                            attempt=attempt, metadata=job.metadata)
