"""Turning jobs and engine outcomes into the records the worker publishes.

Uses the contract models of `schemas/` so every record the worker writes is validated on the way
out (a worker bug shows up as an exception here, not as a malformed record downstream).
"""

from __future__ import annotations

import os
from dataclasses import asdict

from schemas.constants import (
    ERROR_INTERNAL,
    ERROR_PROMPT_TOO_LONG,
    STATUS_ERROR,
    STATUS_EXPIRED,
    STATUS_OK,
    dead_letter_headers,
)
from schemas.records import ErrorInfo, Result, Source, TokenEvent
from schemas.records import TokenLogprob as WireLogprob
from schemas.records import Timing as WireTiming
from schemas.records import Usage as WireUsage
from worker.engine.types import EngineRequest, FinishReason, RequestDelta, SamplingParams
from worker.kafka.publisher import OutRecord

_MAX_ERROR_MESSAGE = 2000


def new_attempt_id(worker_name: str) -> str:
    """Unique per execution: the worker's name plus 48 random bits."""
    return f"{worker_name}-{os.urandom(6).hex()}"


def engine_request(job, request_id: str, arrival_time: float | None = None) -> EngineRequest:
    s = job.sampling
    sampling = SamplingParams(
        max_tokens=s.max_tokens,
        min_tokens=s.min_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
    )
    kwargs = {}
    if arrival_time is not None:
        kwargs["arrival_time"] = arrival_time
    return EngineRequest(
        request_id=request_id,
        prompt=job.prompt,
        messages=[{"role": m.role, "content": m.content} for m in job.messages] if job.messages is not None else None,
        prompt_token_ids=list(job.prompt_token_ids) if job.prompt_token_ids is not None else None,
        sampling=sampling,
        priority=job.priority,
        deadline_ms=job.deadline_ms,
        tenant=job.tenant,
        **kwargs,
    )


def _wire_logprobs(items) -> list[WireLogprob] | None:
    if items is None:
        return None
    out = []
    for lp in items:
        out.append(
            WireLogprob.model_validate(
                {
                    "token_id": lp.token_id,
                    "token": lp.token,
                    "logprob": _finite_or_none(lp.logprob),
                    "top_logprobs": [
                        {"token_id": t, "token": txt, "logprob": _finite_or_none(v)} for t, txt, v in lp.top_logprobs
                    ],
                }
            )
        )
    return out


def _finite_or_none(x: float) -> float | None:
    return None if x != x or x in (float("inf"), float("-inf")) else float(x)


def _clip(message: str) -> str:
    message = message or "unknown error"
    return message if len(message) <= _MAX_ERROR_MESSAGE else message[: _MAX_ERROR_MESSAGE - 3] + "..."


def classify_engine_error(error: str | None) -> tuple[str, str]:
    """An engine error string -> (contract error code, message)."""
    text = error or "the engine failed the request without a reason"
    if text.startswith(ERROR_PROMPT_TOO_LONG):
        return ERROR_PROMPT_TOO_LONG, text.removeprefix(ERROR_PROMPT_TOO_LONG).lstrip(": ") or text
    return ERROR_INTERNAL, text


def result_from_delta(
    job, delta: RequestDelta, *, model: str, worker: str, attempt: str, source: dict
) -> Result:
    """The Result of a finished request (ok, expired, or an engine-side error)."""
    common = dict(
        job_id=job.job_id,
        model=model,
        worker=worker,
        attempt=attempt,
        source=Source.model_validate(source),
        metadata=job.metadata,
        usage=WireUsage.model_validate(asdict(delta.usage)) if delta.usage else WireUsage(),
        timing=WireTiming.model_validate({k: max(0.0, float(v)) for k, v in asdict(delta.timing).items()})
        if delta.timing
        else WireTiming(),
    )
    reason = delta.finish_reason
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return Result(
            status=STATUS_OK,
            text=delta.output_text or "",
            token_ids=list(delta.output_token_ids or []),
            finish_reason=reason.value,
            logprobs=_wire_logprobs(delta.logprobs) if job.sampling.logprobs is not None else None,
            **common,
        )
    if reason == FinishReason.EXPIRED:
        return Result(status=STATUS_EXPIRED, **common)
    code, message = classify_engine_error(delta.error)
    return Result(status=STATUS_ERROR, error=ErrorInfo(code=code, message=_clip(message)), **common)


def error_result(job_id: str, code: str, message: str, *, model: str, worker: str, attempt: str, source: dict,
                 metadata=None) -> Result:
    return Result(
        job_id=job_id,
        status=STATUS_ERROR,
        error=ErrorInfo(code=code, message=_clip(message)),
        model=model,
        worker=worker,
        attempt=attempt,
        source=Source.model_validate(source),
        metadata=metadata,
    )


def expired_result(job, *, model: str, worker: str, attempt: str, source: dict) -> Result:
    return Result(
        job_id=job.job_id, status=STATUS_EXPIRED, model=model, worker=worker, attempt=attempt,
        source=Source.model_validate(source), metadata=job.metadata,
    )


def token_event(job_id: str, attempt: str, index: int, delta: RequestDelta) -> bytes:
    return TokenEvent(
        job_id=job_id, attempt=attempt, index=index, token_ids=list(delta.new_token_ids),
        text=delta.text_delta, finished=bool(delta.finished),
    ).to_json_bytes()


def dead_letter(key: bytes | None, value: bytes | None, code: str, message: str, *, dlq_topic: str,
                source_topic: str, partition: int, offset: int, dlq_partition: int | None) -> OutRecord:
    """Key and value bytes unchanged; the reason and the source in headers."""
    headers = dead_letter_headers(code, _clip(message), topic=source_topic, partition=partition, offset=offset)
    return OutRecord(dlq_topic, key, value, headers, dlq_partition)


def result_record(result: Result, results_topic: str) -> OutRecord:
    return OutRecord(results_topic, result.job_id.encode(), result.to_json_bytes())
