"""Plain data shared by the engine's parts and its callers.

The engine package imports nothing from Kafka, pydantic or boto3: these are dataclasses, so the
engine runs on a machine that has only torch, triton, transformers and safetensors.
"""

from __future__ import annotations

import json as _json
import time
from dataclasses import dataclass, field, fields
from enum import Enum

from tokenmill.engine.fields import problems_of, setting


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
    INVALID_CONSTRAINT = "invalid_constraint"  # its structured_outputs constraint did not compile


# Wire-level limits the engine holds too: counts and token ids fit a signed 32-bit integer, seeds
# a signed 64-bit one (larger values would overflow index tensors or the generator).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LOGPROBS_MAX = 20
N_MAX = 64  # samples of one prompt (sampling.n)

# The kinds of constraint a request may carry (exactly one), in vLLM's `structured_outputs` names.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
WHITESPACE_MODES = ("compact", "flexible")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output: exactly one of json (a JSON Schema, as an object or its text),
    json_object (any JSON object), regex, choice (one of the strings) or grammar (Lark/EBNF text).

    `whitespace` applies to JSON kinds: "compact" allows no free whitespace between JSON tokens,
    "flexible" allows short runs (see worker/engine/structured/llguidance_backend.py).
    Only the shape is checked here; whether the constraint compiles is the compiler's to say
    (an error there fails the request with ErrorKind.INVALID_CONSTRAINT).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace: str = "compact"

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}; got {named}")
        if self.whitespace not in WHITESPACE_MODES:
            raise ValueError(f"structured_outputs.whitespace must be compact or flexible, got {self.whitespace!r}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON Schema object or its JSON text")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, str]:
        """(kind, text, whitespace): what the compiler caches by. A schema given as an object and
        as its text are one key; key order is kept (it is the order the output writes keys in)."""
        kind = self.kind
        if kind == "json":
            value = self.json
            text = value if isinstance(value, str) else _json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = _json.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind)
        return kind, text, self.whitespace


def _structured_outputs(value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
    """A dict (as a Job's model_dump gives it) becomes StructuredOutputsParams."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    unknown = set(value) - {f.name for f in fields(StructuredOutputsParams)}
    if unknown:
        raise ValueError(f"structured_outputs has unknown keys: {', '.join(sorted(unknown))}")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


@dataclass
class SamplingParams:
    """Per-request sampling settings; names and meanings follow OpenAI and vLLM.

    Names, defaults and bounds equal the wire's ``schemas.job.Sampling`` field for field (a test
    compares them), so a Job's sampling maps over by name alone.
    """

    max_tokens: int = setting(256, minimum=0, maximum=INT32_MAX)  # 0 only with prompt_logprobs
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
    structured_outputs: StructuredOutputsParams | None = None  # a dict is accepted and converted
    # Score the prompt: for each position from score_from on, the prompt token's logprob and rank
    # plus the top-N (0 = the token alone); see worker/engine/scoring.py.
    prompt_logprobs: int | None = setting(None, minimum=0, maximum=LOGPROBS_MAX)
    score_from: int = setting(1, minimum=1, maximum=INT32_MAX)  # first prompt position scored
    n: int = setting(1, minimum=1, maximum=N_MAX)  # samples of the prompt (sample_groups.py)

    def __post_init__(self) -> None:
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        problems = problems_of(self, fields(self))
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            problems.append("max_tokens must be >= 1 unless prompt_logprobs is set (max_tokens 0: score only)")
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
    # The caller reads only the final delta (vLLM's FINAL_ONLY output kind; generate(), the offline
    # runner and non-streaming jobs): step() builds no token deltas for the request, and without
    # stop strings its text is decoded once, when it ends (that final delta's text_delta is then
    # the whole text). The final delta is otherwise as for any request: the whole output in
    # output_token_ids / output_text / output_logprobs, the last token in new_token_ids / logprobs.
    final_only: bool = False

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
class PromptLogprob:
    """One scored prompt position: its token's logprob given the tokens before it, its rank among
    the vocabulary (1 = the most likely) and the top-N alternatives as (id, logprob)."""

    position: int
    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # The texts of token_id and of the top-N ids (in their order), filled in when the request ends.
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)


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
class ChoiceOutput:
    """One choice of an n > 1 request, in its group's final delta (sample_groups.py)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # one per token, when logprobs were asked
    completion_tokens: int = 0


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
    # Set when finished, for a request with prompt_logprobs: one record per scored position (from
    # score_from on), their logprobs' sum, and whether every scored token was the most likely one.
    prompt_logprobs: list[PromptLogprob] | None = None
    prompt_logprob_sum: float | None = None
    is_greedy: bool | None = None
    # A request with n > 1: every delta names the choice its tokens belong to; the final one (sent
    # when the last choice ends) carries every choice, and its output_* fields are choice 0's.
    choice: int | None = None
    choices: list[ChoiceOutput] | None = None


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
    # Structured output, observed since the previous stats(drain_observations=True) (the worker's
    # per-step report drains them into its histograms): seconds of each constraint compile, and
    # of each step's mask fill + apply.
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
