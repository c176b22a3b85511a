"""Answer building: an input record, or a job and its final delta, to the records that answer it.

Pure functions: nothing here sends, counts or logs. The job <-> engine mapping and the Result
itself are shared with run-batch and backfill (worker/job_mapping.py); this module adds what only
the Kafka side needs: TokenEvents, dead letters, record envelopes, and which records answer which
input:

- bad input (not decodable, wrong model, sampling values the engine refuses): a dead letter with
  the input's key and value bytes unchanged, plus an error Result when a job_id could be read;
- a deadline passed before the job started: an `expired` Result;
- a finished job: its Result; an engine error (prompt too long, token ids outside the vocabulary,
  a failure) is dead-lettered as well, before the error Result. An engine outcome the contract
  cannot express becomes an `internal` error Result, never a dropped answer.

Every Result and dead letter fits its topic's `max.message.bytes` (`AnswerContext.limits`, read
at start): one that would not is cut down as sizing.py describes (a Result: logprobs dropped,
then text cut, `truncated: true`; else an error Result `result_too_large`, whose input is
dead-lettered too). Each record can also shrink itself further should the broker refuse it
all the same (`OutRecord.shrink`, used by the publisher).

Every record goes through the contract models of `schemas/`, so a worker bug shows up as an
exception here, not as a malformed record downstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from structlog.typing import FilteringBoundLogger

from tokenmill.engine.types import RequestDelta
from tokenmill.job_mapping import build_result, error_result, job_to_engine_request, new_attempt_id
from tokenmill.kafka.publisher import OutRecord
from tokenmill.kafka.registry import PLAIN, Framing
from tokenmill.kafka.sizing import CUT_DEAD_LETTER_VALUE, TopicLimits, fit_dead_letter, fit_result
from tokenmill.kafka.types import Answer, Fetched, InFlightJob
from tokenmill.schemas import DeadLetter, Result, Source, TokenEvent
from tokenmill.schemas.constants import (
    ERROR_INTERNAL,
    ERROR_RESULT_TOO_LARGE,
    STATUS_EXPIRED,
    dead_letter_headers,
)
from tokenmill.schemas.job import Job
from tokenmill.schemas.wire import HEADER_BYTES

__all__ = [
    "AnswerContext",
    "build_result",
    "computed_tokens",
    "dead_letter",
    "dlq_partition",
    "error_result",
    "expired",
    "expired_result",
    "finished",
    "job_to_engine_request",
    "new_attempt_id",
    "rejected",
    "result_record",
    "source_of",
    "token_event",
]

# Header values and error messages stay readable, not megabytes (a huge invalid record's
# validation message could otherwise be as big as the record).
MAX_ERROR_MESSAGE = 2000


@dataclass
class AnswerContext:
    """Who answers, and where the answers go."""

    model: str  # the served model name, written in every Result
    worker: str
    results_topic: str
    dlq_topic: str
    dlq_partitions: int = 0  # partitions of the dead-letter topic; 0 while unknown
    limits: TopicLimits = field(default_factory=TopicLimits)  # the output topics' max.message.bytes
    framing: Framing = field(default_factory=Framing)  # plain JSON, or framed for a schema registry


def clip(message: str) -> str:
    message = message or "unknown error"
    return message if len(message) <= MAX_ERROR_MESSAGE else message[: MAX_ERROR_MESSAGE - 3] + "..."


def source_of(topic: str, partition: int, offset: int) -> Source:
    return Source(topic=topic, partition=partition, offset=offset)


def _source(fetched: Fetched) -> Source:
    return source_of(fetched.tp.topic, fetched.tp.partition, fetched.offset)


def dlq_partition(partition: int, dlq_partitions: int) -> int | None:
    """A dead letter keeps its input's partition number when the dead-letter topic has it;
    otherwise (or while the partition count is unknown) the producer's partitioner chooses."""
    return partition if dlq_partitions and partition < dlq_partitions else None


def expired_result(job: Job, *, model: str, worker: str, attempt: str, source: Source) -> Result:
    """For a job whose deadline had passed when it was fetched (it never reaches the engine)."""
    return Result(
        job_id=job.job_id, status=STATUS_EXPIRED, model=model, worker=worker, attempt=attempt,
        source=source, metadata=job.metadata,
    )


def token_event(job_id: str, attempt: str, index: int, delta: RequestDelta) -> bytes:
    return TokenEvent(
        job_id=job_id, attempt=attempt, index=index, token_ids=[int(t) for t in delta.new_token_ids],
        text=delta.text_delta, finished=bool(delta.finished), choice=delta.choice,
    ).to_json_bytes()


def dead_letter(key: bytes | None, value: bytes | None, code: str, message: str, *, dlq_topic: str,
                source_topic: str, partition: int, offset: int, dlq_partition: int | None,
                limit: int | None = None, framing: Framing = PLAIN, worker: str | None = None) -> OutRecord:
    """Key and value bytes unchanged; the reason and the source in the contract's headers (with a
    schema registry, also as a framed DeadLetter record: registry.py). With a limit (the
    dead-letter topic's max.message.bytes), a value too large is cut (sizing.py); the framed
    record then says the value's full length too (value_original_bytes)."""
    headers = dead_letter_headers(code, clip(message), topic=source_topic, partition=partition, offset=offset)

    def record(original_bytes: int | None) -> OutRecord:
        framed = []
        if framing.framed:
            info = DeadLetter(code=code, message=clip(message), source=source_of(source_topic, partition, offset),
                              worker=worker, value_original_bytes=original_bytes)
            framed = framing.dead_letter_headers(info.to_json_bytes())
        return OutRecord(dlq_topic, key, value, headers + framed, dlq_partition)

    whole = record(None)
    to_cut = record(len(value)) if framing.framed and value else whole
    return _fitted_dead_letter(whole, to_cut, limit)


def _fitted_dead_letter(whole: OutRecord, to_cut: OutRecord, limit: int | None) -> OutRecord:
    """``whole`` when it fits, else ``to_cut`` (the same, its framed metadata naming the value's
    full length) with its value cut to fit."""
    rec, cut = fit_dead_letter(whole, limit) if limit is not None else (whole, False)
    if cut:
        rec, cut = fit_dead_letter(to_cut, limit)  # type: ignore[arg-type]
    rec.cut = CUT_DEAD_LETTER_VALUE if cut else None
    rec.shrink = lambda refused: _fitted_dead_letter(whole, to_cut, refused - 1)
    return rec


def result_record(result: Result, results_topic: str, limit: int | None = None,
                  framing: Framing = PLAIN) -> OutRecord:
    """The Result's record. With a limit (the results topic's max.message.bytes) it is cut down
    to fit (sizing.fit_result, its JSON form with room for a registry's frame); `cut` says how,
    None when it went whole. With a registry the value is framed (registry.py)."""
    if limit is None:
        rec = OutRecord(results_topic, result.job_id.encode(), framing.result(result.to_json_bytes()))
    else:
        room = limit - HEADER_BYTES if framing.framed else limit
        fitted = fit_result(result, room)
        rec = OutRecord(results_topic, result.job_id.encode(), framing.result(fitted.value), cut=fitted.how)
    rec.shrink = lambda refused: result_record(result, results_topic, refused - 1, framing)
    return rec


def _result_of(rec: OutRecord, framing: Framing) -> Result:
    return Result.model_validate(framing.decode_result(rec.value or b""))


def _dead_letter_of(fetched: Fetched, code: str, message: str, ctx: AnswerContext) -> OutRecord:
    tp = fetched.tp
    return dead_letter(
        fetched.key, fetched.value, code, message, dlq_topic=ctx.dlq_topic, source_topic=tp.topic,
        partition=tp.partition, offset=fetched.offset, dlq_partition=dlq_partition(tp.partition, ctx.dlq_partitions),
        limit=ctx.limits.of(ctx.dlq_topic), framing=ctx.framing, worker=ctx.worker,
    )


def _result_record(result: Result, ctx: AnswerContext) -> OutRecord:
    return result_record(result, ctx.results_topic, ctx.limits.of(ctx.results_topic), ctx.framing)


def rejected(fetched: Fetched, code: str, message: str, *, job_id: str | None, attempt: str,
             metadata: dict[str, Any] | None, ctx: AnswerContext, log: FilteringBoundLogger) -> Answer:
    """Input that cannot run: its dead letter, and an error Result when a job_id could be read."""
    records = [_dead_letter_of(fetched, code, message, ctx)]
    if job_id is not None:
        result = error_result(
            job_id, code, clip(message), model=ctx.model, worker=ctx.worker, attempt=attempt,
            source=_source(fetched), metadata=metadata,
        )
        records.append(_result_record(result, ctx))
    return Answer(fetched, records, "dead_letter", code, log)


def expired(fetched: Fetched, job: Job, *, attempt: str, ctx: AnswerContext, log: FilteringBoundLogger) -> Answer:
    result = expired_result(job, model=ctx.model, worker=ctx.worker, attempt=attempt, source=_source(fetched))
    return Answer(fetched, [_result_record(result, ctx)], "expired", None, log)


def computed_tokens(delta: RequestDelta, *, ran_to_the_end: bool = True) -> int:
    """Tokens the engine computed for a request by its final delta: prompt tokens prefilled (not
    served from the prefix cache) and output tokens. An aborted request that produced no token yet
    counts 0 (how much of its prompt was prefilled is not reported)."""
    usage = delta.usage
    if usage is None or (not ran_to_the_end and not usage.completion_tokens):
        return 0
    return max(0, usage.prompt_tokens - usage.cached_prompt_tokens) + usage.completion_tokens


def finished(job: InFlightJob, delta: RequestDelta, ctx: AnswerContext) -> Answer:
    """The answer of a job from its final delta: its Result, after a dead letter on an engine error."""
    source = _source(job.fetched)
    try:
        result = build_result(job.job, delta, model=ctx.model, worker=ctx.worker, attempt=job.attempt, source=source)
    except ValueError as exc:  # an engine outcome the contract cannot express: say so, do not drop
        result = error_result(
            job.job.job_id, ERROR_INTERNAL, clip(str(exc)), model=ctx.model, worker=ctx.worker,
            attempt=job.attempt, source=source, metadata=job.job.metadata,
        )
    rec = _result_record(result, ctx)
    if rec.cut == ERROR_RESULT_TOO_LARGE:
        result = _result_of(rec, ctx.framing)  # the error Result that replaced it
    records = [rec]
    tokens = computed_tokens(delta)
    if result.error is None:  # "error Results carry an error" is checked by the Result itself
        return Answer(job.fetched, records, result.status, None, job.log, tokens)
    # A job that cannot run here (prompt too long), or whose Result the results topic cannot
    # take, is dead-lettered like other bad input, so it can be run again elsewhere.
    code = result.error.code
    records.insert(0, _dead_letter_of(job.fetched, code, result.error.message, ctx))
    return Answer(job.fetched, records, "error", code, job.log, tokens)
