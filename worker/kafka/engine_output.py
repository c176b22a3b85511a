"""Engine output: each step's deltas become TokenEvents, and a finished job becomes its answer.

The engine thread hands over, once per step, the finished deltas and every delta of streaming
jobs (worker/runtime/engine_thread.py). For a delta of a job still in flight:

1. A streaming job gets one TokenEvent for the step (`index` counts from 0 without gaps, the last
   one `finished`), queued on the worker's one ordered token stream.
2. When the job finishes it leaves inflight.py (its tenant slot goes to the next held job) and,
   in a task of its own: its TokenEvents are confirmed (acknowledged by the broker) first, then
   answers.finished builds its answer (cut down where the results topic's size limit requires;
   counted), which goes to delivery. An engine error that makes the input bad after all (prompt
   too long, token ids outside the vocabulary, a constraint that does not compile) is counted
   once more by the bad-input guard: the guard errs towards stopping, never towards missing.

Deltas of jobs no longer in flight (aborted: revoked partition, shutdown) are dropped; the last
one says what the engine had computed for the job, counted as discarded (metrics.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from tokenmill.engine.types import ErrorKind, FinishReason, RequestDelta
from tokenmill.kafka import answers
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.publisher import PublishAbandoned, TokenStream
from tokenmill.kafka.types import Answer, InFlightJob
from tokenmill.metrics import WorkerMetrics

# The engine errors that say the input itself is bad (the others are failures of the worker).
_BAD_INPUT_KINDS = (ErrorKind.PROMPT_TOO_LONG, ErrorKind.INVALID_REQUEST, ErrorKind.INVALID_CONSTRAINT)


@dataclass(eq=False)
class EngineOutput:
    inflight: InFlight
    tokens: TokenStream
    tracker: OffsetTracker[TopicPartition]  # whether a job's partition is still ours (else its answer is void)
    ctx: AnswerContext
    metrics: WorkerMetrics
    record_input: Callable[[str | None], None]  # the bad-input guard's count
    deliver: Callable[[Answer], Awaitable[None]]  # the next step
    spawn: Callable[[Coroutine[Any, Any, None], str], object]  # runs a job's finish as its own task

    def take(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            job = self.inflight.get(delta.request_id)
            if job is None:  # aborted (revoked partition or shutdown): count what was thrown away
                if delta.finished and (where := self.inflight.aborted.pop(delta.request_id, None)) is not None:
                    ran = delta.finish_reason is not FinishReason.ABORTED  # it finished before the abort took
                    self.metrics.count_discarded(*where, answers.computed_tokens(delta, ran_to_the_end=ran))
                continue
            if job.job.stream and (delta.new_token_ids or delta.text_delta or delta.finished):
                payload = self.ctx.framing.token_event(
                    answers.token_event(job.job.job_id, job.attempt, job.next_index, delta))
                if self.tokens.publish(job.job.job_id, payload, job.token_sink):
                    job.next_index += 1  # an event left out for its size takes no index: no gap
            if delta.finished:
                self.inflight.finish(job)
                self.spawn(self._finish(job, delta), f"finish-{job.attempt}")

    async def _finish(self, job: InFlightJob, delta: RequestDelta) -> None:
        f = job.fetched
        if job.job.stream:
            try:
                await self.tokens.confirm(job.token_sink, still_wanted=lambda: self.tracker.owns(f.tp, f.epoch))
            except PublishAbandoned:
                return
        answer = answers.finished(job, delta, self.ctx)
        self.metrics.count_cuts(answer.records)
        if answer.outcome == "error" and delta.error_kind in _BAD_INPUT_KINDS:
            self.record_input(answer.code)
        if answer.outcome == "ok" and delta.timing is not None:
            self.metrics.observe_latency(delta.timing, len(delta.output_token_ids or ()))
        await self.deliver(answer)
