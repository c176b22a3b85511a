"""Raw bytes from the jobs topic (or a JSONL line) -> Job, or one JobDecodeError.

Whatever the input, the decoder returns a Job or raises JobDecodeError with a contract error
code and a readable message; it never lets another exception escape. The JSON text is read
strictly, and the id an input is answered under read first, by json_text.py (which also says
what strict means).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenmill.schemas.errors import JobDecodeError, format_validation_error
from tokenmill.schemas.job import Job
from tokenmill.schemas.json_text import (  # noqa: F401 (load_json, readable_id, job_id_of: this module's API too)
    input_line_id,
    is_openai_batch_line,
    job_id_of,
    load_json,
    readable_id,
)
from tokenmill.schemas.openai_batch import job_from_openai_batch_line


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


@dataclass(frozen=True)
class InputLine:
    """One parsed input line; ``openai_url`` is the line's url when it was an OpenAI batch line."""

    job: Job
    openai_url: str | None = None


def read_input_line(raw: bytes | bytearray | memoryview | str) -> InputLine:
    """A Job line or an OpenAI batch line -> InputLine. Raises only JobDecodeError."""
    obj = load_json(raw)
    if is_openai_batch_line(obj):
        return InputLine(job_from_openai_batch_line(obj), obj.get("url"))
    return InputLine(job_from_object(obj))


def parse_input_line(raw: bytes | bytearray | memoryview | str) -> Job:
    """A Job line or an OpenAI batch line (detected by custom_id + body) -> Job.

    Raises only JobDecodeError; its job_id is the job_id or custom_id when one can be read.
    """
    return read_input_line(raw).job
