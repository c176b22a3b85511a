"""Triton's CPU interpreter (TRITON_INTERPRET=1: the tests, gpu_check's dry run) without two kinds of
work whose result it never uses.

1. The integer overflow checks it computes and then throws away.

For every integer add, sub and mul narrower than 64 bits, Triton's front end builds an overflow check
(both operands cast to int64, the operation again, two compares) and hands it to `device_assert`, which
drops it unless the kernel is built with debug on. On a GPU the dropped check is compiled away. The
interpreter's options never turn debug on, so it runs every check as a few numpy calls per operation
and discards the answer: about a quarter of an interpreted engine step's time (gpu_check's dry-run
structured section: 31 s with the checks, 22 s without, on 2 cores). Were debug on, the checks would
count, and they are left alone.

2. Patching triton.language again for every call of a jit function from a kernel. A launch replaces
the language's builtins with the interpreter's (walking every member of tl, tl.core, tl.math and the
tensor class) and puts them back when the launch ends. A jit function called from the kernel asks for
the same patches again, once per call in every program of the grid; the members are already the
interpreter's, so it replaces nothing that matters, and the walk is about 0.4 ms a call: 28% of the
attention invariance test's time. Inside a launch that has patched the modules a function sees, that
function's call now leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import inspect


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


class _Unpatched:
    """What a call inside a launch gets instead of a patch scope: nothing to put back."""

    def restore(self) -> None:
        pass


def patch_language_once_per_launch() -> bool:
    """Makes the interpreter patch triton.language once per launch, not again on every jit-function
    call inside it; True when done (or already). A Triton without this layout is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:
        return False
    if getattr(patch, "once_per_launch", False):
        return True
    languages = (tl, tl.core)
    patched: dict[int, int] = {}  # id of a language module -> launches running with it patched

    def seen_by(fn) -> list:
        return [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages]

    class _Launch:
        def __init__(self, scope, modules: list) -> None:
            self.scope, self.modules = scope, modules

        def restore(self) -> None:
            for m in self.modules:
                patched[id(m)] -= 1
            self.scope.restore()

    def patch_lang(fn):
        modules = seen_by(fn)
        if modules and all(patched.get(id(m), 0) > 0 for m in modules):
            return _Unpatched()
        scope = patch(fn)
        for m in modules:
            patched[id(m)] = patched.get(id(m), 0) + 1
        return _Launch(scope, modules)

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang
    return True
