"""Per-request state the engine keeps while a request waits, runs and finishes."""

from __future__ import annotations

import enum
import hashlib
import itertools
from typing import Any

from worker.engine.block_manager import BlockState
from worker.engine.types import EngineRequest, ErrorKind, FinishReason, SamplingParams, TokenLogprob

_arrival_counter = itertools.count()


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
    """

    __slots__ = (
        "request_id", "sampling", "priority", "arrival_time", "deadline_ms", "tenant",
        "arrival_seq", "prompt_token_ids", "num_prompt_tokens", "output_token_ids", "kv",
        "num_computed_tokens", "status", "finish_reason", "error_kind", "error", "num_cached_prompt_tokens",
        "num_preemptions", "ever_scheduled", "deferred_steps", "first_scheduled_time",
        "first_token_time", "finish_time", "detokenizer", "sampling_inputs", "output_logprobs",
        "runner_row",
    )

    def __init__(self, req: EngineRequest, prompt_token_ids: list[int]) -> None:
        self.request_id = req.request_id
        self.sampling: SamplingParams = req.sampling
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        self.deadline_ms = req.deadline_ms
        self.tenant = req.tenant
        self.arrival_seq = next(_arrival_counter)  # tie-break for equal arrival times
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        # token_ids = prompt + output, grown by append (never re-concatenated).
        self.kv = BlockState(token_ids=list(self.prompt_token_ids), salt=tenant_salt(req.tenant))
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error_kind: ErrorKind | None = None
        self.error: str | None = None
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.num_preemptions = 0
        self.ever_scheduled = False
        self.deferred_steps = 0  # steps spent held back by prefix-aware admission
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.detokenizer: Any = None
        self.sampling_inputs: Any = None
        # Every output token's logprobs, when asked: the final delta carries the whole list.
        self.output_logprobs: list[TokenLogprob] | None = [] if req.sampling.logprobs is not None else None
        self.runner_row = -1  # row of the model runner's persistent block-table buffer

    @property
    def token_ids(self) -> list[int]:
        return self.kv.token_ids

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Priority (lower first), then arrival."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.kv.token_ids.append(token_id)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.kv.block_table)})"
        )
