"""The structured-output workload: 8 JSON schemas, the requests over them, and the output checks.

`tokenmill bench --workload structured` and tools/gpu_check's `structured` section build their
requests here and judge their outputs with the checks below; the tests import the same checks.

The schemas are the shapes labelling and extraction jobs ask for: nested objects, arrays of
objects, enums, bounded integers and numbers, strings with patterns. Every string has a
`maxLength` or a `pattern` of bounded length, every array a `maxItems`, every object
`additionalProperties: false` with all its keys required, and every number a range and a
`multipleOf`, so even a greedy random-weight model reaches the end of the grammar in a few dozen
tokens. (A bare `number` lets the fraction run on: greedy decoding of a random model then repeats
digits until `max_tokens`. The steps are exact binary fractions, 0.5, 0.25, 0.125, because
jsonschema checks `multipleOf` in floating point, where 0.29 / 0.01 is not a whole number.)

The checks (each returns None when the output passes, else a short reason):
  check_json(text, schema)     parses as JSON and validates against the schema (jsonschema)
  check_choice(text, choices)  is exactly one of the choices
  check_regex(text, pattern)   the whole text matches the pattern (re.fullmatch)
  whitespace_runs(text)        the lengths of the whitespace runs outside JSON strings
  whitespace_run(text)         True when the text holds whitespace outside JSON strings longer than
                               the whitespace setting allows, or ends in whitespace outside a string
                               (the "padding until max_tokens" failure); compact allows none
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

_STRICT = {"additionalProperties": False}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """An object whose keys are all required and nothing else allowed."""
    return {"type": "object", "properties": props, "required": list(props), **_STRICT}


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float, step: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, "multipleOf": step}


def _array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


@dataclass(frozen=True)
class Schema:
    name: str
    schema: dict[str, Any]
    example: Any  # one instance that validates (the tests hold every schema to it)


SKU = r"^[A-Z]{3}-[0-9]{4}$"

SCHEMAS: tuple[Schema, ...] = (
    Schema("person", _obj({
        "name": _pattern(r"^[A-Z][a-z]{1,11}$"),
        "age": _int(0, 120),
        "email": _pattern(r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)$"),
        "tags": _array(_enum("customer", "partner", "staff", "press"), max_items=3),
    }), {"name": "Ada", "age": 36, "email": "ada@example.org", "tags": ["staff"]}),
    Schema("product", _obj({
        "sku": _pattern(SKU),
        "title": _text(24),
        "price": _num(0, 10000, 0.25),
        "in_stock": {"type": "boolean"},
        "dimensions_cm": _obj({"w": _int(1, 500), "h": _int(1, 500), "d": _int(1, 500)}),
    }), {"sku": "ABC-0042", "title": "Desk lamp", "price": 24.5, "in_stock": True,
         "dimensions_cm": {"w": 12, "h": 40, "d": 12}}),
    Schema("review_label", _obj({
        "label": _enum("positive", "negative", "neutral", "mixed"),
        "confidence": _num(0, 1, 0.125),
        "aspects": _array(_obj({"aspect": _text(16), "polarity": _enum("pos", "neg", "neu")}), max_items=3),
    }), {"label": "mixed", "confidence": 0.875, "aspects": [{"aspect": "battery", "polarity": "neg"}]}),
    Schema("address", _obj({
        "street": _text(32),
        "city": _text(20),
        "postcode": _pattern(r"^[0-9]{5}$"),
        "country": _enum("FR", "DE", "US", "GB", "JP"),
        "geo": _obj({"lat": _num(-90, 90, 0.5), "lon": _num(-180, 180, 0.5)}),
    }), {"street": "1 rue de la Paix", "city": "Paris", "postcode": "75002", "country": "FR",
         "geo": {"lat": 48.5, "lon": 2.5}}),
    Schema("event", _obj({
        "title": _text(24),
        "date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
        "attendees": _array(_text(12), max_items=4),
        "priority": _enum("low", "normal", "high"),
        "recurring": {"type": "boolean"},
    }), {"title": "Standup", "date": "2025-03-14", "attendees": ["kim", "lee"], "priority": "normal",
         "recurring": True}),
    Schema("order", _obj({
        "order_id": _int(1, 999999),
        "customer": _obj({"id": _pattern(r"^C[0-9]{6}$"), "vip": {"type": "boolean"}}),
        "items": _array(_obj({"sku": _pattern(SKU), "quantity": _int(1, 99), "unit_price": _num(0, 1000, 0.25)}),
                        max_items=3, min_items=1),
        "status": _enum("pending", "shipped", "delivered", "cancelled"),
    }), {"order_id": 1234, "customer": {"id": "C000123", "vip": False},
         "items": [{"sku": "XYZ-0001", "quantity": 2, "unit_price": 9.75}], "status": "shipped"}),
    Schema("entities", _obj({
        "language": _enum("en", "fr", "de", "es"),
        "entities": _array(_obj({"text": _text(20), "type": _enum("PERSON", "ORG", "LOCATION", "DATE", "OTHER"),
                                 "start": _int(0, 10000)}), max_items=4),
    }), {"language": "en", "entities": [{"text": "Kafka", "type": "OTHER", "start": 10}]}),
    Schema("log_record", _obj({
        "level": _enum("DEBUG", "INFO", "WARN", "ERROR"),
        "status": _int(100, 599),
        "message": _text(40),
        "host": _pattern(r"^[a-z]{2,8}-[0-9]{2}$"),
        "latency_ms": _num(0, 60000, 0.5),
        "labels": _array(_pattern(r"^[a-z]{1,8}=[a-z0-9]{1,8}$"), max_items=3),
    }), {"level": "WARN", "status": 503, "message": "upstream timeout", "host": "web-07", "latency_ms": 1250.5,
         "labels": ["zone=eu1"]}),
)


# ---------------------------------------------------------------------------------------------
# the requests


@dataclass
class StructuredWorkload:
    """Request i asks for SCHEMAS[schema_index[i]] after its prompt (token ids)."""

    prompts: list[list[int]]
    schema_index: list[int]
    max_tokens: int  # the constrained pass's cap; the unconstrained pass takes each output's length
    schemas: tuple[Schema, ...] = field(default=SCHEMAS)

    def schema_of(self, i: int) -> Schema:
        return self.schemas[self.schema_index[i]]


def structured_workload(vocab_size: int, num_requests: int = 256, seed: int = 0, *,
                        prompt_range: tuple[int, int] = (8, 32), max_tokens: int = 256,
                        special: set[int] = frozenset()) -> StructuredWorkload:
    """`num_requests` prompts of random ordinary tokens (lengths uniform in `prompt_range`), request
    i constrained to schema i mod 8, so the schemas share the batch evenly."""
    rng = random.Random(seed + 7)
    lo = max(special) + 1 if special and max(special) < 1000 else 0
    prompts = [[rng.randint(lo, vocab_size - 1) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    return StructuredWorkload(prompts, [i % len(SCHEMAS) for i in range(num_requests)], max_tokens)


# ---------------------------------------------------------------------------------------------
# the checks


def check_json(text: str, schema: dict[str, Any]) -> str | None:
    """None when `text` is one JSON value that validates against `schema`, else why not."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"schema violation at {where}: {error.message}"
    return None


def check_choice(text: str, choices: list[str]) -> str | None:
    return None if text in choices else f"{text[:60]!r} is not one of the {len(choices)} choices"


def check_regex(text: str, pattern: str) -> str | None:
    return None if re.fullmatch(pattern, text) else f"{text[:60]!r} does not match {pattern!r}"


JSON_WHITESPACE = " \t\n\r"


def whitespace_runs(text: str) -> list[int]:
    """Lengths of the whitespace runs outside JSON strings, in order (compact JSON has none).
    Strings are followed with their escapes, so a space or an escaped quote inside a value never
    counts; the text need not be complete JSON (an output cut by max_tokens is read as far as it
    goes)."""
    return _scan_whitespace(text)[0]


def whitespace_run(text: str, max_run: int = 0) -> bool:
    """True when `text` holds a run of whitespace outside JSON strings longer than `max_run`, or
    ends in whitespace outside a string (padding after the value, whatever runs are allowed)."""
    runs, trailing = _scan_whitespace(text)
    return trailing or any(r > max_run for r in runs)


def _scan_whitespace(text: str) -> tuple[list[int], bool]:
    """(the runs outside strings, whether the text ends in one)."""
    runs: list[int] = []
    in_string = escaped = False
    run = 0
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in JSON_WHITESPACE:
            run += 1
            continue
        if run:
            runs.append(run)
        run = 0
        in_string = ch == '"'
    return (runs + [run] if run else runs), run > 0


@dataclass
class OutputCheck:
    """The constrained outputs of one run, judged."""

    outputs: int = 0
    stop: int = 0
    length: int = 0
    other: int = 0  # error, aborted, expired: none is expected
    valid: int = 0  # stop outputs that parse and validate
    whitespace_runs: int = 0
    problems: list[str] = field(default_factory=list)  # the first few invalid outputs, with why

    @property
    def valid_fraction(self) -> float:
        return self.valid / self.stop if self.stop else 0.0


def check_outputs(items: list[tuple[str, str, Schema]], max_run: int = 0, keep: int = 5) -> OutputCheck:
    """Judge (text, finish_reason, schema) triples: stop outputs must parse and validate, every
    output is searched for whitespace runs (`max_run` as in whitespace_run)."""
    out = OutputCheck()
    for text, finish, schema in items:
        out.outputs += 1
        if whitespace_run(text, max_run):
            out.whitespace_runs += 1
        if finish == "stop":
            out.stop += 1
            problem = check_json(text, schema.schema)
            if problem is None:
                out.valid += 1
            elif len(out.problems) < keep:
                out.problems.append(f"{schema.name}: {problem}: {text[:120]!r}")
        elif finish == "length":
            out.length += 1
        else:
            out.other += 1
            if len(out.problems) < keep:
                out.problems.append(f"{schema.name}: finished {finish}")
    return out
