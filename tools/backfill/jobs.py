"""Turn a dataset row into a Job: a prompt template, a prompt column, or a messages column.

`JobSpec.job` builds a row's Job and validates it against the wire contract, once: the backends
take the validated Job as it is (the local engine runs it, Kafka sends its wire form).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.tools.backfill.constraints import fingerprint_form
from tokenmill.tools.backfill.identity import fingerprint

if TYPE_CHECKING:
    from tokenmill.schemas import Job


class RowError(ValueError):
    """This row cannot become a Job (missing column, bad messages...). It gets an error result."""


@dataclass(frozen=True)
class JobSpec:
    """How rows become Jobs. Everything here is part of the generation-config fingerprint."""

    prompt_template: str | None = None  # "Summarize: {text}" (str.format fields name columns)
    prompt_column: str | None = None
    messages_column: str | None = None  # a list of {role, content}, or its JSON text (CSV)
    system_prompt: str | None = None  # with a template or prompt column: sent as chat messages
    model: str | None = None  # the served model name (Kafka), or the checkpoint identity (local)
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    priority: int = 0
    tenant: str | None = None
    metadata_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        chosen = [x for x in (self.prompt_template, self.prompt_column, self.messages_column) if x]
        if len(chosen) != 1:
            raise ValueError("give exactly one of --prompt-template, --prompt-column, --messages-column")
        if self.system_prompt and self.messages_column:
            raise ValueError("--system-prompt goes with --prompt-template or --prompt-column, not --messages-column")
        if self.prompt_template:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None]
            except ValueError as exc:
                raise ValueError(f"--prompt-template: {exc}") from None
            if not fields:
                raise ValueError("--prompt-template names no column (use {column} fields)")
        normalized_sampling(self.sampling)

    @property
    def uses_messages(self) -> bool:
        return bool(self.messages_column or self.system_prompt)

    def fingerprint(self, model_identity: str | None = None) -> str:
        """Fingerprint of everything that decides the output, besides the row itself."""
        return fingerprint(
            {
                "v": 1,
                "prompt_template": self.prompt_template,
                "prompt_column": self.prompt_column,
                "messages_column": self.messages_column,
                "system_prompt": self.system_prompt,
                "model": model_identity if model_identity is not None else self.model,
                "sampling": _fingerprinted_sampling(self.sampling),
                "tenant": self.tenant,
            }
        )

    def job(self, job_id: str, row_number: int, row: dict[str, Any]) -> Job:
        """The row's Job, validated; RowError names what is wrong with it (a missing column, a
        field the contract refuses)."""
        from pydantic import ValidationError

        from tokenmill.schemas import Job, format_validation_error

        try:
            return Job.model_validate(self.job_dict(job_id, row_number, row))
        except ValidationError as exc:
            raise RowError(format_validation_error(exc)) from None

    def job_dict(self, job_id: str, row_number: int, row: dict[str, Any]) -> dict[str, Any]:
        job: dict[str, Any] = {"job_id": job_id}
        if self.messages_column:
            job["messages"] = _messages(row, self.messages_column)
        else:
            if self.prompt_template:
                try:
                    text = self.prompt_template.format_map(_Row(row))
                except (IndexError, ValueError, AttributeError) as exc:
                    raise RowError(f"prompt template: {exc}") from None
            else:
                text = _column(row, self.prompt_column)
                if not isinstance(text, str):
                    raise RowError(f"column {self.prompt_column!r} is {type(text).__name__}, expected text")
            if self.system_prompt:
                job["messages"] = [
                    {"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": text},
                ]
            else:
                job["prompt"] = text
        if self.model:
            job["model"] = self.model
        if self.sampling:
            job["sampling"] = dict(self.sampling)
        if self.stream:
            job["stream"] = True
        if self.priority:
            job["priority"] = self.priority
        if self.tenant:
            job["tenant"] = self.tenant
        metadata = {"row": row_number}
        for col in self.metadata_columns:
            metadata[col] = _column(row, col)
        job["metadata"] = metadata
        return job


def normalized_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling block with every default filled in and numbers in one form, so `0` and `0.0`
    (or an explicit default) fingerprint alike; invalid settings fail here, before any row."""
    from pydantic import ValidationError

    from tokenmill.schemas import Sampling, format_validation_error

    try:
        return Sampling.model_validate(sampling).model_dump(mode="json")
    except ValidationError as exc:
        raise ValueError(f"sampling: {format_validation_error(exc)}") from None


def _fingerprinted_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """normalized_sampling, with the constraint in its fingerprint form (constraints.py); with no
    constraint the key is left out, so an unconstrained backfill keeps the ids it had before the
    field existed."""
    normalized = normalized_sampling(sampling)
    constraint = normalized.pop("structured_outputs", None)
    if constraint is not None:
        normalized["structured_outputs"] = fingerprint_form(constraint)
    return normalized


class _Row(dict):
    def __missing__(self, key):
        raise RowError(f"prompt template names column {key!r}, which this row does not have")


def _column(row: dict[str, Any], name: str | None) -> Any:
    if name not in row:
        raise RowError(f"row has no column {name!r} (columns: {', '.join(map(str, row))})")
    return row[name]


def _messages(row: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = _column(row, name)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"column {name!r} is text but not a JSON list of messages") from None
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise RowError(f"column {name!r} must be a list of {{role, content}} objects")
    return value
