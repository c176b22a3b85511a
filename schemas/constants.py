"""Names and codes of the wire contract (v1): statuses, finish reasons, error codes, headers.

These strings are part of what producers and result readers rely on; they never change meaning.
"""

from __future__ import annotations

from typing import Final, Literal

# The contract's version: raised only for a change that breaks producers or readers (compat.py
# checks every exported schema against the version recorded in schemas/compat/contract.json).
CONTRACT_VERSION: Final = 1

# Result.status
STATUS_OK: Final = "ok"
STATUS_ERROR: Final = "error"
STATUS_EXPIRED: Final = "expired"
STATUSES: Final = (STATUS_OK, STATUS_ERROR, STATUS_EXPIRED)
Status = Literal["ok", "error", "expired"]

# Result.finish_reason (only on status "ok")
FINISH_STOP: Final = "stop"  # EOS, a stop string or a stop token id
FINISH_LENGTH: Final = "length"  # max_tokens or the model's context length
FINISH_REASONS: Final = (FINISH_STOP, FINISH_LENGTH)
FinishReasonName = Literal["stop", "length"]

# Result.error.code, and the dead-letter header tokenmill.error.code
ERROR_INVALID_JOB: Final = "invalid_job"  # not UTF-8, not JSON, not an object, schema violation
ERROR_PROMPT_TOO_LONG: Final = "prompt_too_long"  # prompt (+ chat template) longer than the model allows
ERROR_MODEL_MISMATCH: Final = "model_mismatch"  # job.model is not the worker's served model name
ERROR_INTERNAL: Final = "internal"  # the worker failed while running a valid job
ERROR_CRASHED_WORKER: Final = "crashed_worker"  # in flight each time a worker died, attempts used up
ERROR_RESULT_TOO_LARGE: Final = "result_too_large"  # even cut down, the Result passes the topic's size limit
ERROR_INVALID_CONSTRAINT: Final = "invalid_constraint"  # sampling.structured_outputs does not compile
ERROR_CODES: Final = (
    ERROR_INVALID_JOB,
    ERROR_PROMPT_TOO_LONG,
    ERROR_MODEL_MISMATCH,
    ERROR_INTERNAL,
    ERROR_CRASHED_WORKER,
    ERROR_RESULT_TOO_LARGE,
    ERROR_INVALID_CONSTRAINT,
)
ErrorCode = Literal[
    "invalid_job",
    "prompt_too_long",
    "model_mismatch",
    "internal",
    "crashed_worker",
    "result_too_large",
    "invalid_constraint",
]

# Headers on dead-letter records (values are UTF-8 bytes; partition and offset in decimal).
HEADER_ERROR_CODE: Final = "tokenmill.error.code"
HEADER_ERROR_MESSAGE: Final = "tokenmill.error.message"
HEADER_SOURCE_TOPIC: Final = "tokenmill.source.topic"
HEADER_SOURCE_PARTITION: Final = "tokenmill.source.partition"
HEADER_SOURCE_OFFSET: Final = "tokenmill.source.offset"
# Only on a dead letter whose value was cut to fit the dead-letter topic: the value's full length.
HEADER_VALUE_ORIGINAL_BYTES: Final = "tokenmill.value.original_bytes"
DEAD_LETTER_HEADERS: Final = (
    HEADER_ERROR_CODE,
    HEADER_ERROR_MESSAGE,
    HEADER_SOURCE_TOPIC,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_OFFSET,
)

# Limits of a Job.
JOB_ID_MAX_CHARS: Final = 256
METADATA_MAX_BYTES: Final = 16 * 1024  # compact JSON, UTF-8
STOP_MAX_STRINGS: Final = 16
LOGPROBS_MAX: Final = 20
PROMPT_LOGPROBS_MAX: Final = 20  # sampling.prompt_logprobs: the top-k of each scored prompt position
N_MAX: Final = 64  # sampling.n: samples of one prompt
TOKEN_ID_MAX: Final = 2**31 - 1  # token ids and token counts fit a signed 32-bit integer
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

# sampling.structured_outputs: the kinds of constraint (a job gives exactly one), in vLLM's
# `structured_outputs` names, and the whitespace modes of the JSON kinds.
STRUCTURED_OUTPUT_KINDS: Final = ("json", "json_object", "regex", "choice", "grammar")
WHITESPACE_MODES: Final = ("compact", "flexible")
WhitespaceMode = Literal["compact", "flexible"]

# Message roles a Job may carry (the contract leaves the set open; these are the ones every
# supported chat template renders).
MESSAGE_ROLES: Final = ("system", "user", "assistant")
MessageRole = Literal["system", "user", "assistant"]


def dead_letter_headers(
    code: str, message: str, *, topic: str, partition: int, offset: int
) -> list[tuple[str, bytes]]:
    """The headers of a dead-letter record, in the form Kafka clients take them."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}; expected one of {', '.join(ERROR_CODES)}")
    return [
        (HEADER_ERROR_CODE, code.encode()),
        (HEADER_ERROR_MESSAGE, message.encode("utf-8", errors="replace")),
        (HEADER_SOURCE_TOPIC, topic.encode()),
        (HEADER_SOURCE_PARTITION, str(partition).encode()),
        (HEADER_SOURCE_OFFSET, str(offset).encode()),
    ]
