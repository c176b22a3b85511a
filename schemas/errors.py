"""The one error type of the decoders, and validation errors rendered for a person.

pydantic's own messages ("Input should be greater than or equal to 1") name no field and read
like an exception; producers see these messages in error Results and dead-letter headers, so
each problem is rendered as ``field.path: reason`` and all problems of a record go in one line:
``sampling.max_tokens: must be >= 1; prompt: must not be empty``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from tokenmill.schemas.constants import ERROR_CODES, ERROR_INVALID_JOB

# A record with thousands of bad items (a list of 10^6 strings as token ids) would otherwise
# give a message of megabytes.
MAX_REPORTED_PROBLEMS = 10


class JobDecodeError(ValueError):
    """An input that cannot become a Job.

    ``code`` is one of the contract's error codes, ``message`` says what is wrong for a person,
    ``job_id`` is the job id when one could still be read from the input (so an error Result can
    be published for it), else None.
    """

    def __init__(self, code: str, message: str, job_id: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        if not message:
            raise ValueError("a JobDecodeError needs a message")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.job_id = job_id

    @classmethod
    def invalid(cls, message: str, job_id: str | None = None) -> JobDecodeError:
        return cls(ERROR_INVALID_JOB, message, job_id)


def format_path(loc: Sequence[int | str], rename: Mapping[str, str] | None = None) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; ``rename`` maps a rendered path prefix
    to the name the producer wrote (used for OpenAI batch lines)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    if rename:
        # Longest prefix first, so 'sampling.stop' wins over 'sampling'.
        for old in sorted(rename, key=len, reverse=True):
            if out == old or out.startswith(old + ".") or out.startswith(old + "["):
                return rename[old] + out[len(old) :]
    return out


def _num(value: Any) -> Any:
    # Bounds of float fields come back as floats: say "<= 1", not "<= 1.0".
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _reason(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing"):
        return "must be a number"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind == "string_type":
        return "must be a string"
    if kind in ("list_type", "tuple_type"):
        return "must be a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be an object"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "greater_than_equal":
        return f"must be >= {_num(ctx['ge'])}"
    if kind == "greater_than":
        return f"must be > {_num(ctx['gt'])}"
    if kind == "less_than_equal":
        return f"must be <= {_num(ctx['le'])}"
    if kind == "less_than":
        return f"must be < {_num(ctx['lt'])}"
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} characters"
    if kind == "string_too_long":
        return f"must have at most {ctx['max_length']} characters"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, ")
    msg = str(error["msg"])
    return msg[:1].lower() + msg[1:]


def format_validation_error(exc: ValidationError, rename: Mapping[str, str] | None = None) -> str:
    """All problems of one record in one line: ``path: reason; path: reason``."""
    parts: list[str] = []
    errors = exc.errors(include_url=False, include_input=False)
    for error in errors:
        path = format_path(error["loc"], rename)
        text = f"{path}: {_reason(error)}" if path else _reason(error)
        if text not in parts:
            parts.append(text)
    if len(parts) > MAX_REPORTED_PROBLEMS:
        extra = len(parts) - MAX_REPORTED_PROBLEMS
        parts = parts[:MAX_REPORTED_PROBLEMS] + [f"... and {extra} more problems"]
    return "; ".join(parts) or "invalid"
