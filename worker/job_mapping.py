"""Jobs (the wire contract) to engine requests, and engine outcomes to Results.

Shared by the offline ``run-batch`` command, the Kafka worker and backfill, so a job means the
same thing on every path. Imports only the engine's plain data types (never torch), so it stays
cheap to import on the Kafka side.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, cast

from tokenmill.engine.types import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    RequestDelta,
    SamplingParams,
    TokenLogprob,
)
from tokenmill.schemas import (
    ERROR_CODES,
    ERROR_INTERNAL,
    ERROR_INVALID_CONSTRAINT,
    ERROR_INVALID_JOB,
    ERROR_PROMPT_TOO_LONG,
    STATUS_ERROR,
    STATUS_EXPIRED,
    STATUS_OK,
    ErrorInfo,
    Job,
    Result,
    Source,
)
from tokenmill.schemas import Choice as ChoiceRecord
from tokenmill.schemas import PromptLogprob as PromptLogprobRecord
from tokenmill.schemas import Timing as TimingRecord
from tokenmill.schemas import TokenLogprob as TokenLogprobRecord
from tokenmill.schemas import TopLogprob as TopLogprobRecord
from tokenmill.schemas import Usage as UsageRecord
from tokenmill.schemas.constants import ErrorCode


def job_to_engine_request(
    job: Job, arrival_time: float | None = None, *, request_id: str | None = None
) -> EngineRequest:
    """A validated Job -> EngineRequest. ``request_id`` defaults to the job_id (a caller that may
    run two executions of one job at once must pass distinct ids, e.g. the attempt id);
    ``arrival_time`` (unix seconds) defaults to now."""
    # The wire's Sampling and the engine's SamplingParams have the same fields (a test holds them
    # equal), so the mapping is by name; model_dump copies the lists. structured_outputs comes as
    # a dict (or None), which SamplingParams turns into StructuredOutputsParams.
    sampling = SamplingParams(**job.sampling.model_dump())
    return EngineRequest(
        request_id=job.job_id if request_id is None else request_id,
        prompt=job.prompt,
        messages=None
        if job.messages is None
        else [{"role": m.role, "content": m.content} for m in job.messages],
        prompt_token_ids=None if job.prompt_token_ids is None else list(job.prompt_token_ids),
        sampling=sampling,
        priority=job.priority,
        deadline_ms=None if job.deadline_ms is None else float(job.deadline_ms),
        tenant=job.tenant,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        final_only=not job.stream,  # only a streaming job's token deltas are read
    )


def new_attempt_id(worker: str) -> str:
    """A fresh id for one execution of a job: ``<worker>-<12 random hex digits>``."""
    if not worker:
        raise ValueError("worker name must not be empty")
    return f"{worker}-{secrets.token_hex(6)}"


def _finite_or_none(x: float) -> float | None:
    # JSON has no -infinity; a token the distribution rules out (top-k, min-p) is written as null.
    return x if x == x and abs(x) != float("inf") else None


def _prompt_logprob_fields(delta: RequestDelta) -> dict[str, Any]:
    """prompt_logprobs, prompt_logprob_sum and is_greedy of a scoring request's Result (-inf as
    null; a sum that is -inf is left out)."""
    if delta.prompt_logprobs is None:
        return {}
    total = delta.prompt_logprob_sum
    return {
        "prompt_logprobs": [
            PromptLogprobRecord(
                token_id=p.token_id, token=p.token, logprob=_finite_or_none(float(p.logprob)), rank=p.rank,
                top_logprobs=[
                    TopLogprobRecord(token_id=int(tid), token=text, logprob=_finite_or_none(float(value)))
                    for (tid, value), text in zip(p.top_logprobs, p.top_tokens, strict=True)
                ],
            )
            for p in delta.prompt_logprobs
        ],
        "prompt_logprob_sum": _finite_or_none(float(total)) if total is not None else None,
        "is_greedy": bool(delta.is_greedy),
    }


def _logprob_records(logprobs: list[TokenLogprob]) -> list[TokenLogprobRecord]:
    return [
        TokenLogprobRecord(
            token_id=lp.token_id,
            token=lp.token,
            logprob=_finite_or_none(float(lp.logprob)),
            top_logprobs=[
                TopLogprobRecord(token_id=int(tid), token=text, logprob=_finite_or_none(float(value)))
                for tid, text, value in lp.top_logprobs
            ],
        )
        for lp in logprobs
    ]


def _checked_logprobs(
    job: Job, request_id: str, token_ids: list[int], given: list[TokenLogprob] | None
) -> list[TokenLogprobRecord] | None:
    """The logprob records of one output, when the job asked for them (one per token)."""
    if job.sampling.logprobs is None:
        return None
    if given is None or len(given) != len(token_ids):
        have = 0 if given is None else len(given)
        raise ValueError(
            f"request {request_id}: job asked for logprobs; the final delta has {have} for {len(token_ids)} tokens"
        )
    return _logprob_records(given)


def _choices(job: Job, delta: RequestDelta) -> list[ChoiceRecord] | None:
    """The Result's choices of an n > 1 job (None for n = 1: the Result is as before)."""
    if job.sampling.n == 1:
        return None
    if delta.choices is None or len(delta.choices) != job.sampling.n:
        have = 0 if delta.choices is None else len(delta.choices)
        raise ValueError(f"request {delta.request_id}: job asked for n={job.sampling.n}; the final delta has {have}")
    return [
        ChoiceRecord(
            index=c.index, text=c.text, token_ids=[int(t) for t in c.token_ids], finish_reason=c.finish_reason.value,
            logprobs=_checked_logprobs(job, delta.request_id, c.token_ids, c.logprobs),
            completion_tokens=c.completion_tokens,
        )
        for c in delta.choices
    ]


# The engine's reasons for an ERROR finish -> the contract's error codes: the one table.
ENGINE_ERROR_CODES: dict[ErrorKind, ErrorCode] = {
    ErrorKind.PROMPT_TOO_LONG: ERROR_PROMPT_TOO_LONG,
    ErrorKind.INVALID_REQUEST: ERROR_INVALID_JOB,
    ErrorKind.INTERNAL: ERROR_INTERNAL,
    ErrorKind.INVALID_CONSTRAINT: ERROR_INVALID_CONSTRAINT,
}


def engine_error_code(kind: ErrorKind | None) -> ErrorCode:
    return ENGINE_ERROR_CODES[kind] if kind is not None else ERROR_INTERNAL


def build_result(
    job: Job,
    delta: RequestDelta,
    *,
    model: str,
    worker: str,
    attempt: str,
    source: Source | None = None,
) -> Result:
    """The Result of one execution of ``job`` from its final RequestDelta.

    stop/length -> status ok (with the final delta's output_logprobs when the job asked for
    logprobs); EXPIRED -> expired; ERROR -> error with the code ENGINE_ERROR_CODES gives the
    delta's error_kind; ABORTED -> error ``internal`` (an aborted request normally is not
    published at all: its job is redelivered).
    """
    if not delta.finished or delta.finish_reason is None:
        raise ValueError(
            f"request {delta.request_id}: a Result needs the final delta (finished with a reason)"
        )
    reason = FinishReason(delta.finish_reason)
    usage = delta.usage
    timing = delta.timing
    common: dict[str, Any] = {
        "job_id": job.job_id,
        "model": model,
        "worker": worker,
        "attempt": attempt,
        "usage": UsageRecord(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        )
        if usage is not None
        else UsageRecord(),
        "timing": TimingRecord(
            queue_ms=max(0.0, float(timing.queue_ms)),
            ttft_ms=max(0.0, float(timing.ttft_ms)),
            decode_ms=max(0.0, float(timing.decode_ms)),
            total_ms=max(0.0, float(timing.total_ms)),
        )
        if timing is not None
        else TimingRecord(),
        "source": source,
        "metadata": job.metadata,
    }
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        if delta.output_token_ids is None or delta.output_text is None:
            raise ValueError(
                f"request {delta.request_id}: the final delta lacks output_token_ids/output_text"
            )
        token_ids = [int(t) for t in delta.output_token_ids]
        records = _checked_logprobs(job, delta.request_id, token_ids, delta.output_logprobs)
        return Result(
            status=STATUS_OK,
            text=delta.output_text,
            token_ids=token_ids,
            finish_reason=reason.value,
            logprobs=records,
            choices=_choices(job, delta),
            **_prompt_logprob_fields(delta),
            **common,
        )
    if reason == FinishReason.EXPIRED:
        return Result(status=STATUS_EXPIRED, **common)
    if reason == FinishReason.ERROR:
        code, message = engine_error_code(delta.error_kind), delta.error or "the engine failed without a message"
    else:  # ABORTED
        code, message = ERROR_INTERNAL, f"aborted before finishing{': ' + delta.error if delta.error else ''}"
    return Result(status=STATUS_ERROR, error=ErrorInfo(code=cast(ErrorCode, code), message=message), **common)


def error_result(
    job_id: str,
    code: str,
    message: str,
    *,
    model: str,
    worker: str,
    attempt: str,
    source: Source | None = None,
    metadata: dict[str, Any] | None = None,
) -> Result:
    """An error Result for a job that did not run (invalid input, wrong model, worker failure)."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}; expected one of {', '.join(ERROR_CODES)}")
    return Result(
        job_id=job_id,
        status=STATUS_ERROR,
        model=model,
        worker=worker,
        attempt=attempt,
        source=source,
        metadata=metadata,
        error=ErrorInfo(code=cast(ErrorCode, code), message=message or code),
    )
