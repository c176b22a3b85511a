"""On/off switches read from the environment, one parser for all of them (the kernels' and GEMMs')."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def switch(name: str) -> bool | None:
    """An on/off environment switch: False for 0/false/no/off, True for 1/true/yes/on, None unset.

    Raises ValueError for anything else, so a typo is not taken for the default."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_OFF + _ON)}")
