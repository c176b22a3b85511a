"""Structured output in a backfill: the constraint every row's job carries, and the parsed column.

The constraint is the wire's `sampling.structured_outputs` (see docs/contract.md): `--json-schema
FILE` makes it `{"json": <the schema>}`, `--choice LABEL` (repeated, one label each) makes it
`{"choice": [...]}`, and `--sampling` may give any other kind. It sits in the spec's sampling, so it
is part of the generation-config fingerprint like every other sampling field (jobs.py), in a form
that keeps a schema's key order (`fingerprint_form`). `check_compiles` compiles it once before any
row, so a constraint the matcher refuses stops the run instead of failing every row alike.

`OutputParser` turns each row's Result into its `parsed` output value: the JSON value of a `json` /
`json_object` constraint, the label of a `choice` one. A row gets a value only when its job ended
`ok` with `finish_reason: "stop"` (the grammar complete) and its text parses; otherwise (an error,
a `length` cut, text that does not parse) it gets null and keeps its raw text. Regex and grammar
constraints have no parsed column: their text is the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PARSED_KINDS = ("json", "json_object", "choice")
WHITESPACE = ("compact", "flexible")


def load_json_schema(path: str | Path) -> dict[str, Any]:
    """The JSON Schema object in a local file; ValueError names the file and what is wrong."""
    path = Path(path).expanduser()
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--json-schema: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:  # before ValueError: a decode error is one
        raise ValueError(f"--json-schema: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--json-schema: {path} is not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {path} holds a JSON {_json_type(schema)}, not a JSON Schema object")
    return schema


def constraint_from_options(
    json_schema: str | Path | None = None, choices: list[str] | None = None, whitespace: str | None = None
) -> dict[str, Any] | None:
    """The structured_outputs object the --json-schema / --choice / --whitespace options ask for
    (None when neither is given)."""
    if json_schema is not None and choices:
        raise ValueError("--json-schema and --choice are exclusive: give one of them")
    if whitespace is not None:
        if whitespace not in WHITESPACE:
            raise ValueError(f"--whitespace must be one of {', '.join(WHITESPACE)}, not {whitespace!r}")
        if json_schema is None:
            raise ValueError("--whitespace goes with --json-schema (it sets the whitespace allowed inside JSON)")
    if json_schema is not None:
        constraint: dict[str, Any] = {"json": load_json_schema(json_schema)}
        if whitespace is not None:
            constraint["whitespace"] = whitespace
        return constraint
    if choices:
        labels = list(choices)
        if not all(labels):
            raise ValueError("--choice needs a non-empty label")
        twice = sorted({c for c in labels if labels.count(c) > 1})
        if twice:
            raise ValueError(f"--choice label(s) given more than once: {', '.join(map(repr, twice))}")
        return {"choice": labels}
    return None


def with_constraint(sampling: dict[str, Any], constraint: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling block with the options' constraint in it; a constraint given twice (an option
    and sampling.structured_outputs) is refused, not overridden."""
    if constraint is None:
        return sampling
    if sampling.get("structured_outputs") is not None:
        raise ValueError("--sampling already has structured_outputs; give the constraint once "
                         "(--json-schema, --choice or sampling.structured_outputs)")
    return {**sampling, "structured_outputs": constraint}


def check_compiles(sampling: dict[str, Any]) -> None:
    """Compile the sampling's constraint once before any row, without a model's tokenizer (what
    the matcher refuses there, it refuses for every row alike: a syntax error, an unsupported
    schema feature). ValueError with the matcher's reason; the run then sends no job. What only a
    model's tokenizer or the compile time limit can tell still fails row by row (invalid_constraint)."""
    constraint = sampling.get("structured_outputs")
    if not constraint:
        return
    from tokenmill.engine.structured.backend import ConstraintError
    from tokenmill.engine.structured.llguidance_backend import check_without_tokenizer
    from tokenmill.engine.types import StructuredOutputsParams

    try:
        check_without_tokenizer(StructuredOutputsParams(**constraint))
    except ConstraintError as exc:
        raise ValueError(f"the constraint does not compile: {exc}") from None


def fingerprint_form(structured_outputs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The constraint as the fingerprint sees it: a schema object and its JSON text fingerprint
    alike, and the schema's key order counts (it is the order the output writes keys in, so a
    reordered schema asks a different question); unset kinds are left out."""
    if structured_outputs is None:
        return None
    form = {k: v for k, v in structured_outputs.items() if v not in (None, False)}
    schema = form.get("json")
    if schema is not None:
        value = json.loads(schema) if isinstance(schema, str) else schema
        form["json"] = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return form


class OutputParser:
    """Parses each row's output under one constraint; counts the ok rows that did not parse."""

    def __init__(self, structured_outputs: dict[str, Any]):
        self.kind = next(k for k in PARSED_KINDS if structured_outputs.get(k) not in (None, False))
        self.choices = frozenset(structured_outputs.get("choice") or ())
        self.parsed = 0
        self.unparsed = 0  # ok rows whose output has no parsed value (cut by max_tokens, ...)

    @classmethod
    def for_sampling(cls, sampling: dict[str, Any]) -> OutputParser | None:
        """A parser when the sampling's constraint has a parsed form, else None (no column)."""
        constraint = sampling.get("structured_outputs")
        if not constraint or not any(constraint.get(k) not in (None, False) for k in PARSED_KINDS):
            return None
        return cls(constraint)

    def value(self, result: dict[str, Any]) -> Any:
        """The parsed output of one Result (None: none)."""
        if result.get("status") != "ok":
            return None
        value = self._parse(result.get("text"), result.get("finish_reason"))
        if value is None:
            self.unparsed += 1
        else:
            self.parsed += 1
        return value

    def _parse(self, text: Any, finish_reason: Any) -> Any:
        if finish_reason != "stop" or not isinstance(text, str):
            return None
        if self.kind == "choice":
            return text if text in self.choices else None
        try:
            return json.loads(text)
        except ValueError:
            return None

    def column_text(self, value: Any) -> str | None:
        """The parsed value as a Parquet cell: the label, or compact JSON text."""
        if value is None or self.kind == "choice":
            return value
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__)
