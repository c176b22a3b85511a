"""Triton kernels for tokenmill (`tokenmill.kernels`), each with a plain-torch reference beside it."""

import os

if __name__ == "kernels":
    # In a checkout the repository root is on sys.path (pytest, `python -m` from the root), so this
    # folder is also found under the top-level name `kernels`, which is Hugging Face's package
    # (transformers imports it). Importing that name then gives Hugging Face's package where it is
    # installed (this module puts it in its own place in sys.modules, which the import system
    # returns); where it is not, an empty stand-in, which transformers never asks for.
    import importlib.machinery
    import importlib.util
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
elif os.environ.get("TRITON_INTERPRET") == "1":
    # Interpreted kernels skip work whose result the interpreter never uses (interpreter.py): the
    # overflow checks Triton computes and then drops, and patching the language again on every call
    # of a jit function inside a launch.
    from tokenmill.kernels.interpreter import patch_language_once_per_launch, skip_discarded_overflow_checks

    skip_discarded_overflow_checks()
    patch_language_once_per_launch()
