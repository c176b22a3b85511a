"""KafkaJobRunner: a JobRunner (see worker/eval/lm.py) that runs every Job on a worker fleet.

Each call of the evaluation model (one per lm-eval request type: loglikelihood, rolling
loglikelihood, generation) hands the runner all its Jobs. The runner sends each one to the jobs
topic and gathers the Results from the results topic by job_id, through the backfill's Kafka
backend and its on-disk store (tools/backfill: the results topic is read from positions kept in
the store, committed with the Results they carried; a job answered twice, as at-least-once
delivery may, keeps its first Result). So an evaluation is resumable like a backfill: a rerun
with the same state file sends only the jobs that have no Result yet and reuses the others.

What keeps two evaluations apart:

- the job ids: ``<id_prefix>-<kind>-<index>``, with an id prefix drawn at random when the state
  file is created and kept in it, so evaluations sharing a results topic never take each
  other's Results, and a rerun asks again under the same ids;
- the run's identity (model, tasks, limit, few-shot count...: given by the caller), stored on
  first use: a state file made by another evaluation is refused (EvalStateMismatch), naming
  what differs;
- a fingerprint of each call's Jobs (their wire form), stored per call: if the same identity
  produced other jobs (a task file or the tokenizer changed), the stored Results would answer
  other questions, and the run is refused too.

Scoring jobs that share their context (the choices of one question) are keyed by a hash of it on
the jobs topic, so they land on one partition and one worker's prefix cache computes the context
once; every other job is keyed by its id.

The runner keeps the backend's asyncio loop on a thread of its own; every use of the store
happens on that loop, so the collector and the calls never share the sqlite connection at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from tokenmill.schemas import Job, Result
from tokenmill.tools.backfill.kafka_backend import KafkaBackend, KafkaSettings
from tokenmill.tools.backfill.rows import PlannedRow
from tokenmill.tools.backfill.store import ResultStore

T = TypeVar("T")

META_IDENTITY = "eval_identity"
META_ID_PREFIX = "eval_id_prefix"
META_CALL = "eval_call:{}"
CATCH_UP_S = 60.0  # the longest wait for the results topic to be read up to its end before planning


class EvalIncomplete(RuntimeError):
    """Jobs are still without a Result (timeout); the state is kept, a rerun resumes."""

    def __init__(self, missing: int, total: int, timeout_s: float | None, state: Path):
        self.missing, self.total = missing, total
        super().__init__(
            f"{missing} of {total} job(s) still without a Result after waiting {timeout_s}s; "
            f"rerun the same command with --state {state} to resume (the {total - missing} Result(s) "
            "in are kept)"
        )


class EvalStateMismatch(ValueError):
    """The state file belongs to a different evaluation."""


class ContextKeyedBackend(KafkaBackend):
    """The backfill's Kafka backend, with scoring jobs keyed by their context (see above)."""

    def partition_key(self, job: Job) -> bytes:
        return context_key(job) or super().partition_key(job)


def context_key(job: Job) -> bytes | None:
    """A key shared by the scoring jobs whose prompts agree before their scored part (None for
    other jobs): a hash of those tokens, not the prompt's start, so questions that share only a
    few-shot header still spread over the partitions."""
    ids = job.prompt_token_ids
    if ids is None or job.sampling.prompt_logprobs is None or job.sampling.score_from <= 1:
        return None
    context = ids[: job.sampling.score_from]
    digest = hashlib.sha256(json.dumps(context, separators=(",", ":")).encode()).hexdigest()[:32]
    return f"ctx-{digest}".encode()


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def jobs_fingerprint(jobs: list[Job]) -> str:
    digest = hashlib.sha256()
    for job in jobs:
        digest.update(job.to_json_bytes())
        digest.update(b"\n")
    return digest.hexdigest()


def identity_differences(stored: dict[str, Any], given: dict[str, Any]) -> list[str]:
    keys = sorted(set(stored) | set(given))
    return [f"{k}: {stored.get(k)!r} in the state, {given.get(k)!r} now" for k in keys if stored.get(k) != given.get(k)]


class KafkaJobRunner:
    """Jobs in, their Results by job_id out, through the jobs and results topics.

    ``settings``: the broker, topics, security options and the served model name.
    ``state``: the sqlite state file (created when missing). ``identity``: what names this
    evaluation (plain JSON); a state file made under another identity is refused.
    ``timeout_s``: how long all calls together may wait for Results (None: forever); past it a
    call raises EvalIncomplete naming how many are missing. ``progress``: a bar per call.
    """

    def __init__(self, settings: KafkaSettings, state: str | Path, identity: dict[str, Any], *,
                 timeout_s: float | None = None, progress: bool = False) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"the timeout must be > 0 seconds, got {timeout_s}")
        self.settings = settings
        self.state = Path(state)
        self.identity = json.loads(canonical(identity))
        self.progress = progress
        self.timeout_s = timeout_s
        self.wait_left = timeout_s  # of the timeout, what the calls have not spent waiting yet
        self.sent = 0  # jobs sent by this run
        self.reused = 0  # jobs answered by a Result already in the state
        self.calls = 0
        self.rows = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eval-kafka", daemon=True)
        self._thread.start()
        self.store: ResultStore | None = None
        self.backend: KafkaBackend | None = None
        try:
            self.id_prefix = self._on_loop(self._open())
        except BaseException:
            self.close()
            raise

    # -- the loop thread ---------------------------------------------------------------------
    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C while waiting: the wait on the loop stops too
            future.cancel()
            raise

    async def _open(self) -> str:
        store = ResultStore(self.state, keep_unplanned=True)
        self.store = store
        stored = store.get_meta(META_IDENTITY)
        if stored is None:
            if store.get_meta(META_ID_PREFIX) is not None or store.row_count():
                raise EvalStateMismatch(f"{self.state} is not the state file of an evaluation")
            store.set_meta(META_IDENTITY, canonical(self.identity))
            store.set_meta(META_ID_PREFIX, f"eval-{secrets.token_hex(6)}")
        else:
            diff = identity_differences(json.loads(stored), self.identity)
            if diff:
                raise EvalStateMismatch(
                    f"{self.state} is the state of a different evaluation ({'; '.join(diff)}); "
                    "give another --state, or delete this one to start over"
                )
        prefix = store.get_meta(META_ID_PREFIX)
        assert prefix is not None
        # Rows are this run's jobs so far (a call plans its own); Results stay, for any job of ours.
        store.truncate_rows(0)
        self.backend = ContextKeyedBackend(self.settings, prefix + "-")
        await self.backend.start(store)
        await self._catch_up()
        return prefix

    async def _catch_up(self) -> None:
        """Wait until the collector has read the results topic up to where it ends now, so the
        Results that came while no run was listening (a worker finishing the jobs of a stopped
        run) are in the store before anything is planned, and their jobs are not sent again.
        The collector stores a batch in the same turn of the loop as it fetches it, so once the
        consumer's position is past the end, so is the store."""
        consumer = self.backend.consumer  # type: ignore[union-attr]
        parts = list(consumer.assignment())
        ends = await consumer.end_offsets(parts)
        deadline = time.monotonic() + CATCH_UP_S
        while time.monotonic() < deadline:
            self.backend._raise_if_collector_failed()  # type: ignore[union-attr]
            positions = [await consumer.position(tp) for tp in parts]
            if all(pos >= ends[tp] for pos, tp in zip(positions, parts, strict=True)):
                return
            await asyncio.sleep(0.05)
        # Still behind (a very long topic): go on; a job whose Result is read later is only sent twice.

    async def _run(self, jobs: list[Job]) -> dict[str, Any]:
        store, backend = self.store, self.backend
        assert store is not None and backend is not None
        call = self.calls
        self.calls += 1
        key = META_CALL.format(call)
        fp = jobs_fingerprint(jobs)
        stored_fp = store.get_meta(key)
        if stored_fp is None:
            store.set_meta(key, fp)
        elif stored_fp != fp:
            raise EvalStateMismatch(
                f"call {call} of this evaluation made other jobs than those recorded in {self.state} "
                "(a task file, the tokenizer or lm-eval changed?); give another --state, or delete this one"
            )
        entries = [PlannedRow(self.rows + i, job.job_id, None, False, {}) for i, job in enumerate(jobs)]
        self.rows += len(jobs)
        todo = store.plan_rows(entries, retry_failed=True)  # an error or expired Result is asked again
        self.reused += len(jobs) - len(todo)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), unit="job", file=sys.stderr,
                       dynamic_ncols=True, desc=f"eval (call {call})")
            ours = {job.job_id for job in jobs}
            backend.on_results = lambda added: bar.update(sum(1 for r in added if r.get("job_id") in ours))
        try:
            if todo:
                send = [jobs[i] for i in todo]
                store.mark_submitted([entries[i].number for i in todo])
                await backend.submit(send)
                self.sent += len(send)
                started = time.monotonic()
                await backend.wait_done(self.wait_left)
                if self.wait_left is not None:
                    self.wait_left = max(0.0, self.wait_left - (time.monotonic() - started))
            results = store.results_for(job.job_id for job in jobs)
        finally:
            backend.on_results = lambda added: None
            if bar is not None:
                bar.close()
        missing = len(jobs) - len(results)
        if missing:
            raise EvalIncomplete(missing, len(jobs), self.timeout_s, self.state)
        return results

    async def _close(self) -> None:
        try:
            if self.backend is not None:
                await self.backend.close()
        finally:
            if self.store is not None:
                self.store.close()

    # -- the JobRunner -----------------------------------------------------------------------
    def __call__(self, jobs: list[Job]) -> dict[str, Result]:
        """Every job's Result (each job once; ids distinct). Raises EvalIncomplete when the
        timeout passes first, EvalStateMismatch when the jobs differ from the stored run's."""
        ids = [job.job_id for job in jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate job ids in one call")
        if not jobs:
            return {}
        jobs = [self._for_fleet(job) for job in jobs]
        stored = self._on_loop(self._run(jobs))
        return {job_id: Result.model_validate(res) for job_id, res in stored.items()}

    def _for_fleet(self, job: Job) -> Job:
        """The job as sent: it names the served model, so a worker of another model refuses it
        (an error Result) instead of answering for the wrong model."""
        name = self.settings.model
        if not name or job.model == name:
            return job
        if job.model is not None:
            raise ValueError(f"{job.job_id} names the model {job.model!r}, the fleet serves {name!r}")
        return job.model_copy(update={"model": name})

    def close(self) -> None:
        """Stop the backend, close the state; the runner cannot be called after."""
        if not self._loop.is_running():
            return
        try:
            self._on_loop(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
