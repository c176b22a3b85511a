"""Plain data shared by the engine's parts and its callers.

The engine package imports nothing from Kafka, pydantic or boto3: these are dataclasses, so the
engine runs on a machine that has only torch, triton, transformers and safetensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from enum import Enum

from worker.engine.fields import problems_of, setting


class FinishReason(str, Enum):  # noqa: UP042 (StrEnum would change str() and f-strings of members)
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens, or the model's context length
    EXPIRED = "expired"  # deadline passed before the request started
    ABORTED = "aborted"  # abort(request_id) was called
    ERROR = "error"  # the request could not run (e.g. prompt longer than the model allows)


class ErrorKind(str, Enum):  # noqa: UP042
    """Why a request finished with FinishReason.ERROR. Callers map it to their own error codes
    (worker/job_mapping.py holds the one table for the wire contract)."""

    PROMPT_TOO_LONG = "prompt_too_long"  # more prompt tokens than the engine's max_model_len
    INVALID_REQUEST = "invalid_request"  # refused by add() (e.g. token ids outside the vocabulary)
    INTERNAL = "internal"  # the engine failed on it


# Wire-level limits the engine holds too: counts and token ids fit a signed 32-bit integer, seeds
# a signed 64-bit one (larger values would overflow index tensors or the generator).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LOGPROBS_MAX = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings; names and meanings follow OpenAI and vLLM.

    Names, defaults and bounds equal the wire's ``schemas.job.Sampling`` field for field (a test
    compares them), so a Job's sampling maps over by name alone.
    """

    max_tokens: int = setting(256, minimum=1, maximum=INT32_MAX)
    min_tokens: int = setting(0, minimum=0, maximum=INT32_MAX)
    temperature: float = setting(1.0, minimum=0, finite=True)
    top_p: float = setting(1.0, above=0, maximum=1, finite=True)
    top_k: int = setting(0, minimum=0, maximum=INT32_MAX)  # 0 = off
    min_p: float = setting(0.0, minimum=0, maximum=1, finite=True)
    repetition_penalty: float = setting(1.0, above=0, finite=True)
    presence_penalty: float = setting(0.0, minimum=-2, maximum=2, finite=True)
    frequency_penalty: float = setting(0.0, minimum=-2, maximum=2, finite=True)
    seed: int | None = setting(None, minimum=INT64_MIN, maximum=INT64_MAX)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = setting(None, minimum=0, maximum=LOGPROBS_MAX)  # top-N per token (0 = the chosen one)

    def __post_init__(self) -> None:
        problems = problems_of(self, fields(self))
        if self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class EngineRequest:
    """What a caller hands to Engine.add(). Exactly one of prompt / messages / prompt_token_ids."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    deadline_ms: float | None = None  # unix ms; not started by then -> finish_reason EXPIRED
    tenant: str | None = None  # salts the prefix cache: no cache hits across tenants
    arrival_time: float = field(default_factory=time.time)  # unix seconds

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages, prompt_token_ids is required")


@dataclass
class TokenLogprob:
    """Logprob of one generated token, with the top-N alternatives (OpenAI style)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Timing:
    queue_ms: float = 0.0  # arrival -> first scheduled
    ttft_ms: float = 0.0  # arrival -> first output token
    decode_ms: float = 0.0  # first output token -> finish
    total_ms: float = 0.0  # arrival -> finish


@dataclass
class RequestDelta:
    """What one Engine.step() produced for one request.

    Text is released only once it can no longer be part of a stop string, so concatenating
    every text_delta of a request gives exactly its final text.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked
    usage: Usage | None = None  # always set; final when finished
    timing: Timing | None = None  # set when finished
    error_kind: ErrorKind | None = None  # set with FinishReason.ERROR
    error: str | None = None  # the human-readable reason, with error_kind
    # Whole output, set when finished (so callers need not accumulate).
    output_token_ids: list[int] | None = None
    output_text: str | None = None
    output_logprobs: list[TokenLogprob] | None = None  # one per output token, when logprobs were asked


@dataclass
class EngineStats:
    """A snapshot for callers (backpressure, metrics); totals count since the engine started."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued, preempted ones included
    kv_blocks_total: int = 0  # KV cache pool size
    kv_blocks_used: int = 0  # blocks not on the free list (free cached blocks count as free)
    prompt_tokens_total: int = 0  # prompt tokens of every request added
    cached_prompt_tokens_total: int = 0  # of those, served from the prefix cache
    generated_tokens_total: int = 0  # output tokens emitted
    steps: int = 0  # steps that scheduled something

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
