"""Per-request state the engine keeps while a request waits, runs and finishes."""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.engine.block_manager import BlockState
from tokenmill.engine.sampler import SamplingInputs
from tokenmill.engine.types import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from tokenmill.engine.detokenizer import IncrementalDetokenizer

_arrival_counter = itertools.count()

# Host-side stand-in for a token that was sampled but is still on its way from the device (the
# overlapped mode): it counts towards num_tokens, its id is filled in by resolve_pending.
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def tenant_salt(tenant: str | None) -> bytes:
    """Bytes mixed into every block hash of a tenant's requests (empty for no tenant)."""
    if not tenant:
        return b""
    return hashlib.sha256(b"tokenmill-tenant:" + tenant.encode("utf-8")).digest()


class Request:
    """One request inside the engine.

    The scheduling rule needs one number: `num_computed_tokens` (tokens whose K/V are in the cache).
    Each step the scheduler lets it catch up with `num_tokens` (prompt + generated so far); prefill,
    chunked prefill, decode and recompute after preemption are all this one rule.

    The request owns its tokens: append_output for a token whose id is known; add_pending and
    resolve_pending for one sampled by an overlapped step, whose id comes a step later.
    """

    __slots__ = (
        "request_id", "sampling", "priority", "arrival_time", "deadline_ms", "arrival_seq",
        "prompt_token_ids", "num_prompt_tokens", "output_token_ids", "kv", "num_computed_tokens",
        "status", "finish_reason", "error_kind", "error", "num_cached_prompt_tokens", "ever_scheduled",
        "deferred_steps", "first_scheduled_time", "first_token_time", "detokenizer", "sampling_inputs",
        "output_logprobs", "runner_row", "matcher", "prompt_scores", "next_score_pos", "group", "choice",
        "final_only",
    )

    def __init__(
        self,
        req: EngineRequest,
        prompt_token_ids: list[int],
        *,
        eos_token_ids: Sequence[int] = (),
        detokenizer: IncrementalDetokenizer | None = None,
        final_only: bool = False,
    ) -> None:
        self.request_id = req.request_id
        # The caller reads only the final delta (Engine.add): no token deltas are built.
        self.final_only = final_only
        self.sampling: SamplingParams = req.sampling
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        self.deadline_ms = req.deadline_ms
        self.arrival_seq = next(_arrival_counter)  # tie-break for equal arrival times
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        # token_ids = prompt + output, grown by append (never re-concatenated).
        self.kv = BlockState(token_ids=list(self.prompt_token_ids), salt=tenant_salt(req.tenant))
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None  # set by Scheduler.finish
        self.error_kind: ErrorKind | None = None
        self.error: str | None = None
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.ever_scheduled = False
        self.deferred_steps = 0  # steps spent held back by prefix-aware admission
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.detokenizer = detokenizer
        self.sampling_inputs = SamplingInputs(
            params=req.sampling,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,  # the live list: grows as tokens come
            eos_token_ids=eos_token_ids,
        )
        # Every output token's logprobs, when asked: the final delta carries the whole list.
        self.output_logprobs: list[TokenLogprob] | None = [] if req.sampling.logprobs is not None else None
        # Prompt scoring (scoring.py): the records of the positions scored so far, and the next
        # position to score (kept across preemption, so a recompute scores nothing twice).
        self.prompt_scores: list[PromptLogprob] | None = [] if req.sampling.prompt_logprobs is not None else None
        self.next_score_pos = req.sampling.score_from
        self.runner_row = -1  # row of the model runner's persistent block-table buffer (the runner's)
        # The constraint's matcher, advanced by every output token (structured/constraints.py);
        # None for an unconstrained request, and until its constraint has compiled.
        self.matcher = None
        # A choice of an n > 1 request (sample_groups.py): its SampleGroup and index; None for n = 1.
        self.group = None
        self.choice: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.kv.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.kv.block_table

    @property
    def prefix_cache_limit(self) -> int:
        """The most tokens the prefix cache may serve it: all but the last (whose logits it
        samples from), and for a prompt still to be scored, the tokens before the hidden state
        of the next position to score (a cached block holds no logits)."""
        limit = self.num_tokens - 1
        if self.prompt_scores is not None and self.next_score_pos < self.num_prompt_tokens:
            limit = min(limit, self.next_score_pos - 1)
        return limit

    @property
    def has_pending_token(self) -> bool:
        """Its last token is still on its way from the device: it cannot be hashed or recomputed yet."""
        return self.kv.token_ids[-1] == PENDING_TOKEN

    # ------------------------------------------------------------------ tokens
    def append_output(self, token_id: int, now: float | None = None) -> None:
        """A sampled token whose id is known joins the output (`now`: when it came)."""
        self.output_token_ids.append(token_id)
        self.kv.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now

    def add_pending(self) -> None:
        """A token was sampled on the device and its id is not on the host yet: a placeholder
        takes its place, counted in num_tokens and, for the sampler, as generated."""
        self.kv.token_ids.append(PENDING_TOKEN)
        self.sampling_inputs.num_pending_tokens += 1

    def resolve_pending(self, token_id: int, now: float | None = None) -> None:
        """The id of the oldest placeholder arrived: it replaces the placeholder and joins the output."""
        index = self.num_prompt_tokens + len(self.output_token_ids)
        token_ids = self.kv.token_ids
        if index >= len(token_ids) or token_ids[index] != PENDING_TOKEN:
            raise RuntimeError(f"request {self.request_id!r}: no pending token at position {index}")
        token_ids[index] = token_id
        self.output_token_ids.append(token_id)
        self.sampling_inputs.num_pending_tokens -= 1
        if self.first_token_time is None:
            self.first_token_time = now

    def drop_pending(self) -> None:
        """Take every placeholder out: the step that sampled them failed, their ids never come."""
        token_ids = self.kv.token_ids
        del token_ids[self.num_prompt_tokens + len(self.output_token_ids) :]
        self.sampling_inputs.num_pending_tokens = 0

    def add_logprobs(self, records: list[TokenLogprob]) -> None:
        """Keep the logprobs of new output tokens (for the final delta)."""
        self.output_logprobs.extend(records)

    def add_prompt_scores(self, records: list[PromptLogprob]) -> None:
        """Keep the records of newly scored prompt positions (the next ones, in order)."""
        if records and records[0].position != self.next_score_pos:
            raise RuntimeError(
                f"request {self.request_id!r}: scored position {records[0].position}, expected {self.next_score_pos}"
            )
        self.prompt_scores.extend(records)
        self.next_score_pos += len(records)

    def set_error(self, kind: ErrorKind, message: str) -> None:
        """Why this request cannot run; it ends with FinishReason.ERROR."""
        self.error_kind = kind
        self.error = message

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.kv.block_table)})"
        )
