"""Triton's CPU interpreter (TRITON_INTERPRET=1: the tests, gpu_check's dry run) without the integer
overflow checks it computes and then throws away.

For every integer add, sub and mul narrower than 64 bits, Triton's front end builds an overflow check
(both operands cast to int64, the operation again, two compares) and hands it to `device_assert`, which
drops it unless the kernel is built with debug on. On a GPU the dropped check is compiled away. The
interpreter's options never turn debug on, so it runs every check as a few numpy calls per operation
and discards the answer: about a quarter of an interpreted engine step's time (gpu_check's dry-run
structured section: 31 s with the checks, 22 s without, on 2 cores). Were debug on, the checks would
count, and they are left alone.
"""

from __future__ import annotations

import dataclasses


def skip_discarded_overflow_checks() -> bool:
    """Turns the checks off in the interpreter's options where debug is off; True when it did. A
    Triton without these options (another version's layout) is left as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow")
            or getattr(options, "debug", True)):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
