"""Raw bytes from the jobs topic (or a JSONL line) -> Job, or one JobDecodeError.

Whatever the input, the decoder returns a Job or raises JobDecodeError with a contract error
code and a readable message; it never lets another exception escape. Inputs are JSON as RFC 8259
defines it: UTF-8, no NaN/Infinity, no duplicate keys (which value would win is a guess), no
lone UTF-16 surrogate escapes (they cannot be written back out as UTF-8).

The id comes first: when the strict rules refuse text that is UTF-8 (a lone surrogate escape, a
NaN, a duplicate key, an integer too long to convert), the text is parsed once more without them,
only to read the job id (or an OpenAI batch line's custom_id), so that the input still gets an
error Result under its id. Bytes that are not UTF-8 are not JSON text at all: no id is read from
them. A job_id key given twice is ambiguous and reads as no id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenmill.schemas.constants import JOB_ID_MAX_CHARS
from tokenmill.schemas.errors import JobDecodeError, format_validation_error
from tokenmill.schemas.job import Job

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


def _utf8_text(raw: bytes | bytearray | memoryview | str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobDecodeError.invalid(f"not UTF-8: {exc.reason} at byte {exc.start}") from None


def _load_strict(text: str) -> Any:
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


class _Ambiguous:
    """The value of a key given twice: no id can be read from it."""


def _object_marking_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj[key] = _Ambiguous() if key in obj else value
    return obj


def _load_tolerant(text: str) -> Any:
    """The text parsed without the strict rules, only to read an id from; None if even that fails."""
    try:
        return json.loads(
            text, parse_constant=lambda name: None, parse_int=lambda digits: 0,
            object_pairs_hook=_object_marking_duplicates,
        )
    except (ValueError, RecursionError):
        return None


def job_id_of(obj: Any) -> str | None:
    """The readable job_id of a parsed record, else None."""
    return readable_id(obj.get("job_id")) if isinstance(obj, dict) else None


def input_line_id(obj: Any) -> str | None:
    """The id an input line is answered under: custom_id for an OpenAI batch line, else job_id."""
    if is_openai_batch_line(obj):
        return readable_id(obj.get("custom_id"))
    return job_id_of(obj)


def load_json(
    raw: bytes | bytearray | memoryview | str, *, id_of: Callable[[Any], str | None] = input_line_id
) -> Any:
    """Parse one JSON document strictly; every failure is a JobDecodeError (invalid_job).

    When UTF-8 text fails the strict rules, the error carries ``id_of`` of the same text parsed
    without them (see the module docstring), so the input can still be answered under its id."""
    text = _utf8_text(raw)
    try:
        return _load_strict(text)
    except JobDecodeError as err:
        job_id = id_of(_load_tolerant(text))
        if job_id is None:
            raise
        raise JobDecodeError(err.code, err.message, job_id) from None


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
    job_id = job_id_of(obj)
    try:
        return Job.model_validate(obj)
    except ValidationError as exc:
        raise JobDecodeError.invalid(format_validation_error(exc), job_id) from None
    except RecursionError:
        raise JobDecodeError.invalid("nested too deeply", job_id) from None


def decode_job(raw: bytes | bytearray | memoryview | str) -> Job:
    """The value of a jobs-topic record -> Job. Raises only JobDecodeError, with the job_id when
    one can be read."""
    return job_from_object(load_json(raw, id_of=job_id_of))


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
    from tokenmill.schemas.openai_batch import job_from_openai_batch_line

    obj = load_json(raw)
    if is_openai_batch_line(obj):
        return InputLine(job_from_openai_batch_line(obj), obj.get("url"))
    return InputLine(job_from_object(obj))


def parse_input_line(raw: bytes | bytearray | memoryview | str) -> Job:
    """A Job line or an OpenAI batch line (detected by custom_id + body) -> Job.

    Raises only JobDecodeError; its job_id is the job_id or custom_id when one can be read.
    """
    return read_input_line(raw).job
