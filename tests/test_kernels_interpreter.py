"""kernels/interpreter.py: the interpreter skips the overflow checks Triton would compute and drop, and
patches triton.language once per launch, not again on every jit-function call inside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from tokenmill.kernels.interpreter import patch_language_once_per_launch, skip_discarded_overflow_checks


@triton.jit
def _double_kernel(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, x + x)


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _quadruple_kernel(x_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, _twice(_twice(tl.load(x_ptr + i))))


def _double(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _double_kernel[(1,)](x, out)
    return out


@pytest.fixture
def builder(monkeypatch):
    """The interpreter's builder, its options restored after the test."""
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", builder.options)
    return builder


def test_the_tests_interpreter_runs_without_the_checks():
    options = interpreter.interpreter_builder.options
    assert options.debug is False and options.sanitize_overflow is False


def test_with_debug_off_an_overflow_passes_the_check_unnoticed_so_skipping_it_changes_nothing(builder):
    """The premise: with debug off, Triton computes the check and drops it. Should a Triton version
    start to act on it, this fails and the skip must go."""
    big = torch.tensor([2**30 + 5], dtype=torch.int32)
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=True, debug=False)
    wrapped = _double(big)
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    assert torch.equal(_double(big), wrapped) and wrapped.item() < 0  # wrapped around, unreported


def test_with_debug_on_the_checks_count_and_are_kept(builder):
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=True, debug=True)
    assert skip_discarded_overflow_checks() is False and builder.options.sanitize_overflow is True
    with pytest.raises(Exception, match="overflow"):
        _double(torch.tensor([2**30 + 5], dtype=torch.int32))


def test_skipping_is_idempotent(builder):
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=True, debug=False)
    assert skip_discarded_overflow_checks() and skip_discarded_overflow_checks()
    assert builder.options.sanitize_overflow is False


def test_a_launch_patches_the_language_once_whatever_its_grid_and_helper_calls(monkeypatch):
    assert patch_language_once_per_launch() and patch_language_once_per_launch()  # on, and idempotent
    walks = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: walks.append(1) or real(*a))
    counts = []
    for n in (1, 40):
        walks.clear()
        x = torch.arange(n, dtype=torch.float32)
        out = torch.empty_like(x)
        _quadruple_kernel[(n,)](x, out)
        assert torch.equal(out, 4 * x)  # the helper ran interpreted, with the language patched
        counts.append(len(walks))
    # The same walks for 1 program as for 40, each calling the helper twice: only the launch's.
    assert counts[0] == counts[1] > 0
    # And the launch put the language back: tl's builtins are Triton's own again.
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__)
