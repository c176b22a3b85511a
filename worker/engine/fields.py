"""Dataclass fields that carry their own bounds: one place for a setting's default, limits and help.

EngineConfig (config.py) and SamplingParams (types.py) declare their fields with ``setting(...)``
and validate with ``check_setting``; the CLI derives flags from the same metadata, and a test
holds SamplingParams equal to the wire's Sampling model bound for bound.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, field
from typing import Any


def setting(
    default: Any = MISSING,
    *,
    help: str = "",
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    finite: bool = False,
    flag: str | None = None,
    negated_flag: bool = False,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field with what a flag and a validation need.

    ``minimum``/``maximum`` are inclusive bounds, ``above`` an exclusive lower bound, ``finite``
    refuses inf and nan; None values are allowed when the default is None. ``flag`` overrides the
    derived ``--field-name``; ``negated_flag`` makes a bool field a store-false flag.
    """
    meta = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "above": above,
        "maximum": maximum,
        "finite": finite,
        "flag": flag,
        "negated_flag": negated_flag,
    }
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_setting(f: Field, value: Any) -> str | None:
    """The problem with one field's value, or None."""
    meta = f.metadata
    if value is None and f.default is None:
        return None
    if meta["choices"] is not None:
        ok = value in meta["choices"]
        return None if ok else f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}"
    if meta["finite"] and not math.isfinite(value):
        return f"{f.name} must be a finite number"
    low, above, high = meta["minimum"], meta["above"], meta["maximum"]
    ok = (low is None or value >= low) and (above is None or value > above) and (high is None or value <= high)
    return None if ok else f"{f.name} must be {describe_bounds(meta)}"


def describe_bounds(meta) -> str:
    """'>= 1', '> 0', 'in (0, 1]' ... for a setting's metadata (also used in flag errors)."""
    low, above, high = meta["minimum"], meta["above"], meta["maximum"]
    if high is not None and (low is not None or above is not None):
        left = f"[{low:g}" if low is not None else f"({above:g}"
        return f"in {left}, {high:g}]"
    if low is not None:
        return f">= {low:g}"
    if above is not None:
        return f"> {above:g}"
    return f"<= {high:g}"


def problems_of(obj: Any, fields_: tuple[Field, ...]) -> list[str]:
    """Every problem of a dataclass instance's bounded fields, listed at once."""
    return [p for f in fields_ if "minimum" in f.metadata and (p := check_setting(f, getattr(obj, f.name)))]
