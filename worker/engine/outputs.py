"""What the engine hands back per request and step: RequestDelta, its Timing and logprob records.

A delta is built from the request's own state: a token delta carries the new token, the text it
released and the usage so far; the final delta also carries the whole output (tokens, text and,
when asked, every token's logprobs), the timing, and the error of a request that could not run.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.engine.request import Request
from tokenmill.engine.sampler import SampledToken
from tokenmill.engine.types import FinishReason, RequestDelta, Timing, TokenLogprob, Usage


def token_delta(req: Request, token_id: int, text: str, logprobs: list[TokenLogprob] | None) -> RequestDelta:
    """One new token of a request that goes on."""
    return RequestDelta(
        request_id=req.request_id, new_token_ids=[token_id], text_delta=text, logprobs=logprobs,
        usage=Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens),
        choice=req.choice,
    )


def final_delta(
    req: Request,
    reason: FinishReason,
    now: float,
    new_ids: list[int] | None = None,
    text: str = "",
    logprobs: list[TokenLogprob] | None = None,
) -> RequestDelta:
    """The last delta of a request that ends now with `reason` (new_ids: its last token, if any)."""
    error = reason is FinishReason.ERROR
    return RequestDelta(
        request_id=req.request_id,
        new_token_ids=new_ids if new_ids is not None else [],
        text_delta=text,
        finished=True,
        finish_reason=reason,
        logprobs=logprobs,
        usage=Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens),
        timing=timing(req, now),
        error_kind=req.error_kind if error else None,
        error=req.error if error else None,
        output_token_ids=list(req.output_token_ids),
        output_text=req.detokenizer.text if req.detokenizer is not None else "",
        output_logprobs=list(req.output_logprobs) if req.output_logprobs is not None else None,
        **prompt_score_fields(req, reason),
    )


def prompt_score_fields(req: Request, reason: FinishReason) -> dict:
    """prompt_logprobs, prompt_logprob_sum and is_greedy of a scoring request's final delta (a
    request that ended before its prompt was scored, e.g. aborted or failed, has none)."""
    scores = req.prompt_scores
    if scores is None or reason in (FinishReason.ERROR, FinishReason.ABORTED, FinishReason.EXPIRED) \
            or req.next_score_pos < req.num_prompt_tokens:
        return {}
    return {
        "prompt_logprobs": list(scores),
        "prompt_logprob_sum": sum(s.logprob for s in scores),
        "is_greedy": all(s.rank == 1 for s in scores),
    }


def timing(req: Request, now: float) -> Timing:
    """Where a request that ends at `now` spent its time (milliseconds, never negative)."""
    arrival = req.arrival_time
    first_sched = req.first_scheduled_time if req.first_scheduled_time is not None else now
    first_tok = req.first_token_time
    return Timing(
        queue_ms=max(0.0, (first_sched - arrival) * 1000.0),
        ttft_ms=max(0.0, (first_tok - arrival) * 1000.0) if first_tok is not None else 0.0,
        decode_ms=max(0.0, (now - first_tok) * 1000.0) if first_tok is not None else 0.0,
        total_ms=max(0.0, (now - arrival) * 1000.0),
    )


def token_logprobs(token_id: int, sampled: SampledToken, decode: Callable[[int], str]) -> list[TokenLogprob]:
    """The logprob record of one sampled token, with its top alternatives (decode: id -> text)."""
    # The sampler's ids and logprobs are Python ints and floats already (from tolist()); this runs for
    # every row of every step that wants logprobs, so nothing is converted again.
    logprob = sampled.logprob
    return [TokenLogprob(token_id, decode(token_id), logprob if logprob is not None else 0.0,
                         [(i, decode(i), lp) for i, lp in sampled.top_logprobs])]
