"""The Job: one prompt job as producers put it on the jobs topic (contract v1).

Validation is strict wherever a lax conversion would silently change a job: ``"10"``, ``10.0``
and ``true`` are not integers, ``1`` is not a boolean, unknown fields (top level, in
``sampling`` and in messages) are rejected so a typo cannot turn into a default. Numbers given
as integers are accepted where the contract asks for a float (``"temperature": 0``).
"""

from __future__ import annotations

import json
import warnings
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from tokenmill.schemas.constants import (
    INT64_MAX,
    INT64_MIN,
    JOB_ID_MAX_CHARS,
    LOGPROBS_MAX,
    METADATA_MAX_BYTES,
    N_MAX,
    PROMPT_LOGPROBS_MAX,
    STOP_MAX_STRINGS,
    STRUCTURED_OUTPUT_KINDS,
    TOKEN_ID_MAX,
    MessageRole,
    WhitespaceMode,
)
from tokenmill.schemas.json_text import load_json

# Shared field types. Counts and token ids fit a signed 32-bit integer: larger values can only be
# mistakes, and they would overflow the engine's index tensors instead of failing here clearly.
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
Count = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
JobId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=JOB_ID_MAX_CHARS,
        description="The idempotency key; echoed in every TokenEvent and Result. 1..256 characters.",
    ),
]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


class StrictModel(BaseModel):
    """Strict types, unknown fields rejected."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Message(StrictModel):
    """One chat message. It goes through the model's chat template."""

    role: MessageRole = Field(description="system, user or assistant")
    content: str = Field(description="The message text (may be empty, e.g. an empty system message).")


def _given_kinds(value: Any) -> list[str]:
    # json_object: false counts as absent, like null.
    return [k for k in STRUCTURED_OUTPUT_KINDS if getattr(value, k) not in (None, False)]


# The field `json` keeps vLLM's name; it shadows pydantic's deprecated BaseModel.json() method,
# which nothing here uses.
warnings.filterwarnings(
    "ignore", message='Field name "json" in "StructuredOutputs" shadows', category=UserWarning
)


class StructuredOutputs(StrictModel):
    """A constraint on the output: exactly one of json, json_object, regex, choice or grammar
    (vLLM's structured_outputs names), plus whitespace for the JSON kinds. A constraint that does
    not compile fails the job with invalid_constraint."""

    # Checked here: the shape (one kind, the types, non-empty texts and choices, a schema given as
    # text is a JSON object). Not here: whether it compiles (a syntax error, a feature the matcher
    # does not support, a compile past its time limit): the engine's compiler says (its field
    # names and defaults are held equal to these by tests/test_sampling_fields.py).

    # Exactly one kind; null (and json_object: false) counts as absent.
    model_config = StrictModel.model_config | ConfigDict(
        json_schema_extra={
            "oneOf": [
                {
                    "required": [name],
                    "properties": {
                        name: {"const": True} if name == "json_object" else {"not": {"type": "null"}}
                    },
                }
                for name in STRUCTURED_OUTPUT_KINDS
            ],
        }
    )

    json: dict[str, Any] | str | None = Field(
        default=None,
        description="A JSON Schema, as an object or as its JSON text: the output is a JSON value it accepts.",
    )
    json_object: bool = Field(default=False, description="true: the output is any JSON object.")
    regex: str | None = Field(
        default=None, min_length=1, description="The output matches this regular expression."
    )
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="The output is exactly one of these strings."
    )
    grammar: str | None = Field(
        default=None, min_length=1, description="A Lark/EBNF grammar; the output is a sentence of it."
    )
    whitespace: WhitespaceMode = Field(
        default="compact",
        description="For json and json_object: compact = no free whitespace; flexible = short runs allowed.",
    )

    @field_validator("json", mode="wrap")
    @classmethod
    def _schema_object_or_text(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # One message for the union (pydantic would report each arm apart).
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError("must be a JSON Schema object or its JSON text") from None
        if isinstance(value, str):
            try:
                schema = load_json(value, id_of=lambda _: None)
            except ValueError as exc:  # JobDecodeError: "not JSON: ..."
                raise ValueError(getattr(exc, "message", str(exc))) from None
            if not isinstance(schema, dict):
                raise ValueError("the JSON text must hold a JSON Schema object")
        return value

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> StructuredOutputs:
        given = _given_kinds(self)
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} is required (got {got})")
        return self

    @property
    def kind(self) -> str:
        return _given_kinds(self)[0]


class Sampling(StrictModel):
    """How tokens are drawn. Names and meanings follow the OpenAI and vLLM conventions."""

    # The rules between fields that JSON Schema can say (the validators below enforce them all).
    model_config = StrictModel.model_config | ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
                    "then": {
                        "required": ["prompt_logprobs"],
                        "properties": {"prompt_logprobs": {"type": "integer"}, "structured_outputs": {"type": "null"}},
                    },
                },
                {
                    "if": {"properties": {"score_from": {"exclusiveMinimum": 1}}, "required": ["score_from"]},
                    "then": {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"type": "integer"}}},
                },
            ]
        }
    )

    max_tokens: int = Field(
        default=256,
        ge=0,
        le=TOKEN_ID_MAX,
        description="Most tokens to generate; 0 (score the prompt only) only with prompt_logprobs.",
    )
    min_tokens: Count = Field(
        default=0, description="EOS and stop token ids are suppressed until this many tokens."
    )
    temperature: FiniteFloat = Field(default=1.0, ge=0, description="0 means greedy.")
    top_p: FiniteFloat = Field(default=1.0, gt=0, le=1, description="Nucleus sampling: 0 < p <= 1.")
    top_k: Count = Field(default=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: FiniteFloat = Field(
        default=0.0, ge=0, le=1, description="Drop tokens below min_p x the top probability."
    )
    repetition_penalty: FiniteFloat = Field(default=1.0, gt=0, description="> 0; 1 = off (vLLM convention).")
    presence_penalty: FiniteFloat = Field(default=0.0, ge=-2, le=2, description="-2..2 (OpenAI convention).")
    frequency_penalty: FiniteFloat = Field(default=0.0, ge=-2, le=2, description="-2..2 (OpenAI convention).")
    seed: Int64 | None = Field(default=None, description="Same seed, same tokens, alone or in any batch.")
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        max_length=STOP_MAX_STRINGS,
        description="At most 16 non-empty strings; the text ends just before the first one hit.",
    )
    stop_token_ids: list[TokenId] = Field(default_factory=list, description="Token ids that end the output.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (until max_tokens).")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=LOGPROBS_MAX,
        description="null = none; N in 0..20 = the chosen token's logprob plus the top N alternatives.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="Constrain the output to a JSON Schema, any JSON object, a regex, a choice or a grammar.",
    )
    # Scoring and sampling fields, appended in the order of the engine's SamplingParams.
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=PROMPT_LOGPROBS_MAX,
        description="null = none; K in 0..20 = score the prompt: each scored position's token logprob "
        "and rank plus the top K.",
    )
    score_from: int = Field(
        default=1,
        ge=1,
        le=TOKEN_ID_MAX,
        description="The first prompt position scored (0-based; position 0 has no logprob); the context "
        "before it may come from the prefix cache. Only with prompt_logprobs.",
    )
    n: int = Field(
        default=1,
        ge=1,
        le=N_MAX,
        description="Independent samples of the prompt, 1..64; sample i uses seed + i when seed is given.",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _fields_agree(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Rules between fields, read from the input so that they are reported together with the
        # fields' own problems (an "after" validator would not run when a field is invalid), each
        # at the field it names. A rule whose fields have the wrong type is left to their errors.
        rules = _agreement_errors(data) if isinstance(data, dict) else []
        try:
            sampling = handler(data)
        except ValidationError as exc:
            if not rules:
                raise
            order = list(cls.model_fields)
            errors = sorted(
                [*exc.errors(), *rules],
                key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else -1,
            )
            raise ValidationError.from_exception_data(cls.__name__, errors) from None  # type: ignore[arg-type]
        if rules:
            raise ValidationError.from_exception_data(cls.__name__, rules)
        return sampling

    @model_validator(mode="after")
    def _min_not_above_max(self) -> Sampling:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


def _is_int(value: Any) -> bool:
    return type(value) is int


def _agreement_errors(data: dict[str, Any]) -> list[InitErrorDetails]:
    """The rules between Sampling's fields, on its input dict."""
    problems: list[tuple[str, str]] = []
    max_tokens, scored = data.get("max_tokens", 256), data.get("prompt_logprobs") is not None
    if _is_int(max_tokens) and max_tokens == 0:
        if not scored:
            problems.append(("max_tokens", "must be >= 1 (0, score only, needs prompt_logprobs)"))
        if data.get("structured_outputs") is not None:
            problems.append(("structured_outputs", "needs max_tokens >= 1 (max_tokens 0 generates nothing)"))
    score_from = data.get("score_from", 1)
    if _is_int(score_from) and score_from > 1 and not scored:
        problems.append(("score_from", "needs prompt_logprobs (it says where prompt scoring starts)"))
    seed, n = data.get("seed"), data.get("n", 1)
    if _is_int(seed) and _is_int(n) and 1 <= n <= N_MAX and seed <= INT64_MAX < seed + n - 1:
        problems.append(("n", f"seed + n - 1 must fit a signed 64-bit integer (seed {seed}, n {n})"))
    return [
        InitErrorDetails(type=PydanticCustomError("value_error", message), loc=(name,), input=data.get(name))
        for name, message in problems
    ]


def metadata_json_size(metadata: dict[str, Any]) -> int:
    """Size of metadata as compact UTF-8 JSON, the measure of the 16 KiB limit."""
    return len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())


class Job(StrictModel):
    """One prompt job (the value of a record on the jobs topic)."""

    # Exactly one prompt form; null counts as absent.
    model_config = StrictModel.model_config | ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                for name in PROMPT_FIELDS
            ],
        }
    )

    job_id: JobId
    prompt: str | None = Field(default=None, min_length=1, description="A plain prompt (non-empty).")
    messages: list[Message] | None = Field(
        default=None, min_length=1, description="Chat messages, rendered with the model's chat template."
    )
    prompt_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, description="An already tokenized prompt."
    )
    model: str | None = Field(
        default=None, min_length=1, description="When given, must equal the worker's served model name."
    )
    sampling: Sampling = Field(default_factory=lambda: Sampling())
    stream: bool = Field(default=False, description="Publish TokenEvents while generating.")
    priority: Int64 = Field(default=0, description="Lower runs first.")
    deadline_ms: Int64 | None = Field(
        default=None, ge=0, description="Unix time in ms; a job not started by then gets status expired."
    )
    tenant: str | None = Field(
        default=None, min_length=1, max_length=256, description="Quota and prefix-cache isolation unit."
    )
    metadata: dict[str, Any] | None = Field(
        default=None, description="Echoed unchanged in the Result; at most 16 KiB as compact UTF-8 JSON."
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            size = metadata_json_size(value)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be plain JSON ({exc})") from None
        if size > METADATA_MAX_BYTES:
            raise ValueError(f"is {size} bytes as JSON; at most {METADATA_MAX_BYTES} are allowed")
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> Job:
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"exactly one of prompt, messages, prompt_token_ids is required (got {got})")
        return self

    def to_json_bytes(self) -> bytes:
        """The wire form (UTF-8 JSON with the fields that were given; defaults left implicit)."""
        return self.model_dump_json(exclude_unset=True).encode()
