"""Raw bytes from the jobs topic (or a JSONL line) -> Job, or one JobDecodeError.

Whatever the input, the decoder returns a Job or raises JobDecodeError with a contract error
code and a readable message; it never lets another exception escape. Inputs are JSON as RFC 8259
defines it: UTF-8, no NaN/Infinity, no duplicate keys (which value would win is a guess), no
lone UTF-16 surrogate escapes (they cannot be written back out as UTF-8).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from schemas.constants import JOB_ID_MAX_CHARS
from schemas.errors import JobDecodeError, format_validation_error
from schemas.job import Job

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise JobDecodeError.invalid(f"not JSON: {name} is not a JSON value")


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise JobDecodeError.invalid(f"not JSON: duplicate key {dup!r}")
    return obj


def load_json(raw: bytes | bytearray | memoryview | str) -> Any:
    """Parse one JSON document strictly; every failure is a JobDecodeError (invalid_job)."""
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JobDecodeError.invalid(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, object_pairs_hook=_object_without_duplicates
        )
    except JobDecodeError:
        raise
    except RecursionError:
        raise JobDecodeError.invalid("not JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints longer than Python converts
        raise JobDecodeError.invalid(f"not JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise JobDecodeError.invalid("not JSON: a string holds a lone UTF-16 surrogate escape") from None
        except RecursionError:
            raise JobDecodeError.invalid("not JSON: nested too deeply") from None
    return value


def readable_id(value: Any) -> str | None:
    """A value usable as job_id of an error Result, else None."""
    if isinstance(value, str) and 1 <= len(value) <= JOB_ID_MAX_CHARS:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return value
    return None


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def job_from_object(obj: Any) -> Job:
    """A parsed JSON value -> Job; schema violations become JobDecodeError (invalid_job)."""
    if not isinstance(obj, dict):
        raise JobDecodeError.invalid(f"a job must be a JSON object, got {_kind(obj)}")
    job_id = readable_id(obj.get("job_id"))
    try:
        return Job.model_validate(obj)
    except ValidationError as exc:
        raise JobDecodeError.invalid(format_validation_error(exc), job_id) from None
    except RecursionError:
        raise JobDecodeError.invalid("nested too deeply", job_id) from None


def decode_job(raw: bytes | bytearray | memoryview | str) -> Job:
    """The value of a jobs-topic record -> Job. Raises only JobDecodeError."""
    return job_from_object(load_json(raw))


def is_openai_batch_line(obj: Any) -> bool:
    """OpenAI batch lines are told apart from Jobs by having both custom_id and body."""
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


@dataclass(frozen=True)
class InputLine:
    """One parsed input line; ``openai_url`` is the line's url when it was an OpenAI batch line."""

    job: Job
    openai_url: str | None = None


def read_input_line(raw: bytes | bytearray | memoryview | str) -> InputLine:
    """A Job line or an OpenAI batch line -> InputLine. Raises only JobDecodeError."""
    from schemas.openai_batch import job_from_openai_batch_line

    obj = load_json(raw)
    if is_openai_batch_line(obj):
        return InputLine(job_from_openai_batch_line(obj), obj.get("url"))
    return InputLine(job_from_object(obj))


def parse_input_line(raw: bytes | bytearray | memoryview | str) -> Job:
    """A Job line or an OpenAI batch line (detected by custom_id + body) -> Job.

    Raises only JobDecodeError; its job_id is the job_id or custom_id when one can be read.
    """
    return read_input_line(raw).job
