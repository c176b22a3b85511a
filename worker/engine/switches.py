"""On/off switches read from the environment, one parser for all of them (the kernels' and GEMMs')."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

# The kernels ask their switch on every call, several times per layer, on the step's host path:
# os.environ.get of an unset name costs ~0.7 us (the name encoded, a KeyError raised and caught),
# 0.7% of a 2-thread tiny-llama run's main-thread samples in py-spy. os.environ keeps its encoded
# copy in `_data` (CPython, every version this project supports): a lookup there reads the same
# live state in ~20 ns. Where that copy is missing, the public path.
_ENCODED = getattr(os.environ, "_data", None)
_encoded_names: dict[str, object] = {}


def _raw(name: str) -> str | None:
    if _ENCODED is None:
        return os.environ.get(name)
    key = _encoded_names.get(name)
    if key is None:
        key = _encoded_names[name] = os.environ.encodekey(name)
    value = _ENCODED.get(key)
    return None if value is None else os.environ.decodevalue(value)


def switch(name: str) -> bool | None:
    """An on/off environment switch: False for 0/false/no/off, True for 1/true/yes/on, None unset.

    Raises ValueError for anything else, so a typo is not taken for the default."""
    return parse_switch(name, _raw(name))


def parse_switch(name: str, raw: str | None) -> bool | None:
    """`switch` for a value read elsewhere (an environment given as a mapping)."""
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_OFF + _ON)}")
