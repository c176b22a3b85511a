"""vLLM's RequestOutputs as tokenmill's RequestDeltas: one Tracked per request, fed every output vLLM
gives for it, giving back the deltas the caller expects.

What each side does:
- vLLM (output kind DELTA) hands each step's new tokens, their text (held back near a possible stop
  string, so the pieces add up to the final text) and their logprobs, per choice (`index`); the
  whole-prompt logprobs of a scoring request come with the prompt's outputs; `finished` comes with
  the request's last output (for n > 1, when its last choice ends).
- Tracked keeps each choice's tokens, text and logprob records, cuts the prompt's records from
  score_from on, and builds token deltas (only for a caller who reads every delta) and the one
  final delta: the whole output, usage with vLLM's prefix-cache hits, timing, and for n > 1 every
  choice (tokenmill's rule: the worst finish wins, an error fails the request).
- A score-only request (max_tokens 0) asked vLLM for one token: it is dropped here, and the request
  ends with LENGTH like on tokenmill's own engine.

Token texts in logprob records come from the caller's `token_text` (the model folder's tokenizer,
one id at a time, as tokenmill's own engine writes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.types import (
    ChoiceOutput,
    EngineRequest,
    ErrorKind,
    FinishReason,
    PromptLogprob,
    RequestDelta,
    Timing,
    TokenLogprob,
    Usage,
)

# vLLM's finish reasons (vllm.v1.engine.FINISH_REASON_STRINGS) -> ours.
FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORTED,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}
# A request's finish when its choices disagree: the worst wins (engine/sample_groups.py's rule).
_SEVERITY = {FinishReason.ERROR: 4, FinishReason.ABORTED: 3, FinishReason.EXPIRED: 2,
             FinishReason.LENGTH: 1, FinishReason.STOP: 1}

TokenText = Callable[[int], str]


@dataclass
class ChoiceState:
    """One choice's output so far."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: FinishReason | None = None

    @property
    def whole_text(self) -> str:
        return "".join(self.text)


@dataclass
class Tracked:
    """A request inside vLLM, from add to its final delta."""

    request: EngineRequest
    prompt_ids: list[int]
    emit_tokens: bool  # the caller reads every delta (not final_only)
    added_at: float  # wall clock, when add() handed it to vLLM
    choices: list[ChoiceState] = field(default_factory=list)
    scores: list[PromptLogprob] = field(default_factory=list)
    prompt_positions_seen: int = 0
    first_output_at: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        n = self.request.sampling.n
        wants_logprobs = self.request.sampling.logprobs is not None
        self.choices = [ChoiceState(logprobs=[] if wants_logprobs else None) for _ in range(n)]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def started(self) -> bool:
        """vLLM has given anything for it: its prompt is being computed or done."""
        return self.first_output_at is not None

    @property
    def score_only(self) -> bool:
        return self.request.sampling.max_tokens == 0

    # -- in --------------------------------------------------------------------------------------
    def take(self, output: Any, now: float, token_text: TokenText) -> list[RequestDelta]:
        """One vLLM RequestOutput of this request; the deltas it gives (the final one last)."""
        if self.first_output_at is None:
            self.first_output_at = now
        if output.num_cached_tokens:
            self.cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs:
            self._take_prompt_logprobs(output.prompt_logprobs, token_text)
        metrics = getattr(output, "metrics", None)
        if metrics is not None:
            self.preemptions = getattr(metrics, "num_preemptions", 0) or 0
        deltas = []
        for completion in output.outputs:
            delta = self._take_completion(completion, token_text)
            if delta is not None and self.emit_tokens:
                deltas.append(delta)
        if output.finished:
            deltas.append(self.final(self._finish_reason(), now, metrics=metrics))
        return deltas

    def _take_completion(self, c: Any, token_text: TokenText) -> RequestDelta | None:
        choice = self.choices[c.index]
        if c.finish_reason is not None:
            choice.finish = FINISH_REASONS.get(str(c.finish_reason), FinishReason.ERROR)
        if self.score_only:
            return None  # the one token vLLM had to sample is not part of the answer
        new_ids = [int(t) for t in c.token_ids]
        choice.token_ids += new_ids
        choice.text.append(c.text)
        records = None
        if choice.logprobs is not None and c.logprobs:
            records = [token_record(t, entry, self.request.sampling.logprobs or 0, token_text)
                       for t, entry in zip(new_ids, c.logprobs, strict=True)]
            choice.logprobs += records
        if not new_ids and not c.text:
            return None
        return RequestDelta(
            request_id=self.request_id, new_token_ids=new_ids, text_delta=c.text, logprobs=records,
            usage=self._usage(), choice=c.index if len(self.choices) > 1 else None,
        )

    def _take_prompt_logprobs(self, entries: list, token_text: TokenText) -> None:
        """The prompt positions of this output (vLLM gives the whole prompt, position 0 as None);
        those from score_from on become records."""
        top_n = self.request.sampling.prompt_logprobs or 0
        score_from = self.request.sampling.score_from
        for entry in entries:
            position = self.prompt_positions_seen
            self.prompt_positions_seen += 1
            if entry is None or position < score_from or position >= len(self.prompt_ids):
                continue
            token_id = self.prompt_ids[position]
            own = entry[token_id]
            top = _top(entry, top_n)
            self.scores.append(PromptLogprob(
                position=position, token_id=token_id, logprob=float(own.logprob), rank=int(own.rank),
                top_logprobs=[(tid, lp) for tid, lp in top], token=token_text(token_id),
                top_tokens=[token_text(tid) for tid, _ in top],
            ))

    # -- out -------------------------------------------------------------------------------------
    def _usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids),
                     completion_tokens=sum(len(c.token_ids) for c in self.choices),
                     cached_prompt_tokens=self.cached_tokens)

    def _finish_reason(self) -> FinishReason:
        reasons = [c.finish or FinishReason.ERROR for c in self.choices]
        if self.score_only:
            return FinishReason.LENGTH if all(_SEVERITY[r] <= 1 for r in reasons) else max(reasons, key=_SEVERITY.get)
        worst = max(reasons, key=_SEVERITY.get)
        return reasons[0] if _SEVERITY[worst] <= 1 else worst

    def final(self, reason: FinishReason, now: float, *, error_kind: ErrorKind | None = None,
              error: str | None = None, metrics: Any = None) -> RequestDelta:
        """The request's last delta: ended with `reason` (an error names its kind and message)."""
        if reason is FinishReason.ERROR and error_kind is None:
            error_kind, error = ErrorKind.INTERNAL, error or "vLLM ended the request with an error"
        first = self.choices[0]
        scored = bool(self.scores) and reason in (FinishReason.STOP, FinishReason.LENGTH)
        choices = None
        if len(self.choices) > 1:
            choices = [
                ChoiceOutput(index=i, token_ids=list(c.token_ids), text=c.whole_text,
                             finish_reason=c.finish or reason, logprobs=c.logprobs, completion_tokens=len(c.token_ids))
                for i, c in enumerate(self.choices)
            ]
        return RequestDelta(
            request_id=self.request_id, new_token_ids=[], text_delta="", finished=True, finish_reason=reason,
            usage=self._usage(), timing=self.timing(now, metrics), error_kind=error_kind, error=error,
            output_token_ids=list(first.token_ids), output_text=first.whole_text,
            output_logprobs=list(first.logprobs) if first.logprobs is not None else None,
            prompt_logprobs=list(self.scores) if scored else None,
            prompt_logprob_sum=sum(s.logprob for s in self.scores) if scored else None,
            is_greedy=all(s.rank == 1 for s in self.scores) if scored else None,
            choices=choices,
        )

    def timing(self, now: float, metrics: Any = None) -> Timing:
        """Milliseconds from arrival; vLLM's own clock (from the request's queueing on) where it
        gives one, the adapter's wall clock otherwise."""
        arrival = self.request.arrival_time
        to_vllm = max(0.0, self.added_at - arrival)
        queue_s = to_vllm
        first_s = (self.first_output_at - arrival) if self.first_output_at is not None else None
        if metrics is not None and getattr(metrics, "queued_ts", 0) and getattr(metrics, "scheduled_ts", 0):
            queue_s = to_vllm + max(0.0, metrics.scheduled_ts - metrics.queued_ts)
            if getattr(metrics, "first_token_ts", 0):
                first_s = to_vllm + max(0.0, metrics.first_token_ts - metrics.queued_ts)
        total_s = max(0.0, now - arrival)
        return Timing(
            queue_ms=queue_s * 1000.0,
            ttft_ms=max(0.0, first_s) * 1000.0 if first_s is not None else 0.0,
            decode_ms=max(0.0, total_s - first_s) * 1000.0 if first_s is not None else 0.0,
            total_ms=total_s * 1000.0,
        )


def _top(entry: dict, n: int) -> list[tuple[int, float]]:
    """The top-n (id, logprob) of one position's vLLM logprob dict, most likely first (the dict also
    holds the chosen or prompt token, whatever its rank)."""
    if n <= 0:
        return []
    ranked = sorted(((lp.rank, int(tid), float(lp.logprob)) for tid, lp in entry.items() if lp.rank is not None))
    return [(tid, logprob) for rank, tid, logprob in ranked if rank <= n][:n]


def token_record(token_id: int, entry: dict, top_n: int, token_text: TokenText) -> TokenLogprob:
    """The logprob record of one generated token from vLLM's dict for its position."""
    own = entry[token_id]
    return TokenLogprob(
        token_id=token_id, token=token_text(token_id), logprob=float(own.logprob),
        top_logprobs=[(tid, token_text(tid), lp) for tid, lp in _top(entry, top_n)],
    )
