"""Strict JSON text, and the id an input is answered under: below the Job models and the decoders.

Inputs are JSON as RFC 8259 defines it: UTF-8, no NaN/Infinity, no duplicate keys (which value
would win is a guess), no lone UTF-16 surrogate escapes (they cannot be written back out as UTF-8).
When the strict rules refuse text that is UTF-8, the text is parsed once more without them, only
to read the job id (or an OpenAI batch line's custom_id), so that the input still gets an error
Result under its id. Bytes that are not UTF-8 are not JSON text at all: no id is read from them.
A job_id key given twice is ambiguous and reads as no id.

The Job model (job.py), the OpenAI batch mapping (openai_batch.py) and the decoder (decode.py)
all read JSON through here; this module imports none of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tokenmill.schemas.constants import JOB_ID_MAX_CHARS
from tokenmill.schemas.errors import JobDecodeError

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


def is_openai_batch_line(obj: Any) -> bool:
    """OpenAI batch lines are told apart from Jobs by having both custom_id and body."""
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj
