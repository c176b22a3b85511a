"""What workers publish: TokenEvents (the stream) and Results (one per execution of a job).

Readers are tolerant: unknown fields in these records are ignored, so a reader keeps working
when a newer worker adds a field (the contract only changes in backwards-compatible ways).
Types are still strict, and a Result's status, finish_reason and error must agree.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from tokenmill.schemas.constants import (
    STATUS_ERROR,
    STATUS_OK,
    ErrorCode,
    FinishReasonName,
    Status,
)
from tokenmill.schemas.job import Count, FiniteFloat, JobId, TokenId

NonNegativeMs = Annotated[FiniteFloat, Field(ge=0)]


class RecordModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenEvent(RecordModel):
    """New tokens of one attempt of a streaming job (value on the tokens topic, key job_id)."""

    job_id: JobId
    attempt: str = Field(min_length=1, description="Unique per execution; a new attempt restarts the text.")
    index: Count = Field(description="Counts this attempt's events from 0 without gaps.")
    token_ids: list[TokenId] = Field(description="Token ids new in this event.")
    text: str = Field(description="Text new in this event (held back while it could start a stop string).")
    finished: bool = Field(default=False, description="True on the attempt's last event.")
    choice: Count | None = Field(
        default=None,
        description="For a job with sampling.n > 1: the choice these tokens belong to; absent otherwise.",
    )

    @model_serializer(mode="wrap")
    def _omit_absent_choice(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("choice") is None:  # n = 1: the event is as before
            data.pop("choice", None)
        return data

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class Usage(RecordModel):
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_prompt_tokens: Count = Field(default=0, description="Prompt tokens served from the prefix cache.")


class Timing(RecordModel):
    queue_ms: NonNegativeMs = Field(default=0.0, description="Arrival at the engine -> first scheduled.")
    ttft_ms: NonNegativeMs = Field(default=0.0, description="Arrival -> first output token.")
    decode_ms: NonNegativeMs = Field(default=0.0, description="First output token -> finish.")
    total_ms: NonNegativeMs = Field(default=0.0, description="Arrival -> finish.")


class Source(RecordModel):
    """Where the job came from (absent for jobs that did not come from Kafka)."""

    topic: str = Field(min_length=1)
    partition: Count
    offset: Annotated[int, Field(ge=0)]


class ErrorInfo(RecordModel):
    code: ErrorCode
    message: str = Field(min_length=1)


class TopLogprob(RecordModel):
    token_id: TokenId
    token: str
    logprob: FiniteFloat | None = Field(description="null stands for -infinity (JSON has no infinity).")


class TokenLogprob(RecordModel):
    """The chosen token's logprob and the top-N alternatives at that position."""

    token_id: TokenId
    token: str
    logprob: FiniteFloat | None = Field(description="null stands for -infinity (JSON has no infinity).")
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(RecordModel):
    """One scored prompt position: the prompt's own token there, its logprob and rank, and the top-K."""

    token_id: TokenId
    token: str
    logprob: FiniteFloat | None = Field(description="null stands for -infinity (JSON has no infinity).")
    rank: int = Field(ge=1, description="1 = the most likely token at this position.")
    top_logprobs: list[TopLogprob] = Field(default_factory=list, description="The K most likely tokens.")


class Choice(RecordModel):
    """One of the n samples of a job with sampling.n > 1."""

    index: Count = Field(description="0..n-1; sample i was drawn with seed + i when a seed was given.")
    text: str = Field(default="")
    token_ids: list[TokenId] = Field(default_factory=list)
    finish_reason: FinishReasonName
    logprobs: list[TokenLogprob] | None = Field(default=None, description="One per generated token, when asked.")
    completion_tokens: Count = Field(default=0, description="Tokens generated for this choice.")

    @model_serializer(mode="wrap")
    def _omit_absent_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("logprobs") is None:
            data.pop("logprobs", None)
        return data


# Optional parts left out of the wire form when they are not there ("logprobs appears when asked").
_OMITTED_WHEN_NONE = (
    "source", "metadata", "error", "logprobs", "truncated",
    "prompt_logprobs", "prompt_logprob_sum", "is_greedy", "choices",
)


# Parts a Result has only with status ok (JSON Schema form).
_ONLY_WHEN_OK: dict[str, Any] = {
    name: {"type": "null"} for name in ("prompt_logprobs", "prompt_logprob_sum", "is_greedy", "choices")
}


class Result(RecordModel):
    """The completion record of one execution of a job (value on the results topic, key job_id)."""

    # Which fields each status needs, for JSON Schema readers (the validators below enforce it).
    model_config = RecordModel.model_config | ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"status": {"const": "ok"}}, "required": ["status"]},
                    "then": {
                        "required": ["finish_reason"],
                        "properties": {
                            "finish_reason": {"enum": ["stop", "length"]},
                            "error": {"type": "null"},
                        },
                    },
                },
                {
                    "if": {"properties": {"status": {"const": "error"}}, "required": ["status"]},
                    "then": {
                        "required": ["error"],
                        "properties": {"error": {"type": "object"}, **_ONLY_WHEN_OK},
                    },
                },
                {
                    "if": {"properties": {"status": {"const": "expired"}}, "required": ["status"]},
                    "then": {"properties": {"error": {"type": "null"}, **_ONLY_WHEN_OK}},
                },
                {
                    "if": {"properties": {"prompt_logprobs": {"type": "array"}}, "required": ["prompt_logprobs"]},
                    "then": {"required": ["is_greedy"], "properties": {"is_greedy": {"type": "boolean"}}},
                },
            ]
        }
    )

    job_id: JobId
    status: Status
    text: str = Field(default="", description="The generated text (empty unless status is ok).")
    token_ids: list[TokenId] = Field(default_factory=list, description="The generated token ids.")
    finish_reason: FinishReasonName | None = Field(
        default=None, description="stop (EOS, stop string or stop token) or length; null unless status is ok."
    )
    model: str = Field(description="The worker's served model name.")
    worker: str = Field(description="The worker that ran this execution.")
    attempt: str = Field(min_length=1, description="Unique per execution of the job.")
    usage: Usage = Field(default_factory=lambda: Usage())
    timing: Timing = Field(default_factory=lambda: Timing())
    source: Source | None = None
    metadata: dict[str, Any] | None = Field(default=None, description="The job's metadata, unchanged.")
    error: ErrorInfo | None = Field(default=None, description="Set exactly when status is error.")
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="One per generated token, when asked."
    )
    truncated: bool | None = Field(
        default=None,
        description="true when the Result was cut down to fit the results topic's size limit (logprobs "
        "dropped first, then text past a limit); absent otherwise.",
    )
    prompt_logprobs: list[PromptLogprob] | None = Field(
        default=None,
        description="With sampling.prompt_logprobs: one entry per scored prompt position, from "
        "sampling.score_from to the prompt's end, in order.",
    )
    prompt_logprob_sum: FiniteFloat | None = Field(
        default=None,
        description="With prompt_logprobs: the sum of the scored tokens' logprobs (absent when one is "
        "-infinity).",
    )
    is_greedy: bool | None = Field(
        default=None,
        description="With prompt_logprobs: true when every scored token was the most likely one (rank 1).",
    )
    choices: list[Choice] | None = Field(
        default=None,
        description="With sampling.n > 1: the n samples, by index; text, token_ids, finish_reason and "
        "logprobs of the Result are those of choice 0. Absent for n = 1.",
    )

    @model_validator(mode="after")
    def _status_agrees(self) -> Result:
        if self.status == STATUS_ERROR:
            if self.error is None:
                raise ValueError("a Result with status error needs an error {code, message}")
        elif self.error is not None:
            raise ValueError(f"a Result with status {self.status} must not carry an error")
        if self.status == STATUS_OK and self.finish_reason is None:
            raise ValueError("a Result with status ok needs a finish_reason")
        if self.status != STATUS_OK and self.finish_reason is not None:
            raise ValueError(f"a Result with status {self.status} has no finish_reason")
        if self.status != STATUS_OK:
            for name in ("prompt_logprobs", "prompt_logprob_sum", "is_greedy", "choices"):
                if getattr(self, name) is not None:
                    raise ValueError(f"a Result with status {self.status} has no {name}")
        if self.prompt_logprobs is None and (self.prompt_logprob_sum is not None or self.is_greedy is not None):
            raise ValueError("prompt_logprob_sum and is_greedy come only with prompt_logprobs")
        if self.prompt_logprobs is not None and self.is_greedy is None:
            raise ValueError("a Result with prompt_logprobs needs is_greedy")
        if self.choices is not None:
            indexes = [c.index for c in self.choices]
            if indexes != list(range(len(indexes))) or len(indexes) < 2:
                raise ValueError(f"choices must be indexed 0..n-1 in order, n >= 2 (got indexes {indexes})")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in _OMITTED_WHEN_NONE:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    def to_json_bytes(self) -> bytes:
        """The wire form (UTF-8 JSON)."""
        return self.model_dump_json().encode()


class DeadLetter(RecordModel):
    """What a dead letter is (value on the dead-letter topic: the input's bytes, unchanged). With a
    schema registry it travels framed in the `tokenmill.error` header; without one, the same
    facts are the plain `tokenmill.error.*` and `tokenmill.source.*` headers."""

    code: ErrorCode
    message: str = Field(min_length=1, description="Why the input could not run, for a person.")
    source: Source = Field(description="The input record: topic, partition, offset.")
    worker: str | None = Field(default=None, description="The worker that dead-lettered it.")
    value_original_bytes: Count | None = Field(
        default=None, description="Set when the value was cut to fit the dead-letter topic: its full length."
    )

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()
