"""Turning jobs and engine outcomes into the records the worker publishes.

The job <-> engine mapping is shared with run-batch and backfill (worker/job_mapping.py); this
module adds what only the Kafka side needs: TokenEvents, dead letters and record envelopes.
Every record goes through the contract models of `schemas/`, so a worker bug shows up as an
exception here, not as a malformed record downstream.
"""

from __future__ import annotations

from schemas import Result, Source, TokenEvent
from schemas.constants import STATUS_EXPIRED, dead_letter_headers
from worker.engine.types import RequestDelta
from worker.job_mapping import build_result, error_result, job_to_engine_request, new_attempt_id
from worker.kafka.publisher import OutRecord

__all__ = [
    "build_result",
    "dead_letter",
    "error_result",
    "expired_result",
    "job_to_engine_request",
    "new_attempt_id",
    "result_record",
    "source_of",
    "token_event",
]

# Header values and error messages stay readable, not megabytes (a huge invalid record's
# validation message could otherwise be as big as the record).
MAX_ERROR_MESSAGE = 2000


def clip(message: str) -> str:
    message = message or "unknown error"
    return message if len(message) <= MAX_ERROR_MESSAGE else message[: MAX_ERROR_MESSAGE - 3] + "..."


def source_of(topic: str, partition: int, offset: int) -> Source:
    return Source(topic=topic, partition=partition, offset=offset)


def expired_result(job, *, model: str, worker: str, attempt: str, source: Source) -> Result:
    """For a job whose deadline had passed when it was fetched (it never reaches the engine)."""
    return Result(
        job_id=job.job_id, status=STATUS_EXPIRED, model=model, worker=worker, attempt=attempt,
        source=source, metadata=job.metadata,
    )


def token_event(job_id: str, attempt: str, index: int, delta: RequestDelta) -> bytes:
    return TokenEvent(
        job_id=job_id, attempt=attempt, index=index, token_ids=[int(t) for t in delta.new_token_ids],
        text=delta.text_delta, finished=bool(delta.finished),
    ).to_json_bytes()


def dead_letter(key: bytes | None, value: bytes | None, code: str, message: str, *, dlq_topic: str,
                source_topic: str, partition: int, offset: int, dlq_partition: int | None) -> OutRecord:
    """Key and value bytes unchanged; the reason and the source in the contract's headers."""
    headers = dead_letter_headers(code, clip(message), topic=source_topic, partition=partition, offset=offset)
    return OutRecord(dlq_topic, key, value, headers, dlq_partition)


def result_record(result: Result, results_topic: str) -> OutRecord:
    return OutRecord(results_topic, result.job_id.encode(), result.to_json_bytes())
