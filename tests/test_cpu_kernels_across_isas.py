"""A Result must not depend on the CPU that computed it: a job redelivered from a worker with AVX-512
to one with AVX2 only (or neither) gets the same bits. Each C kernel whose numbers reach a Result
(the fixed-order GEMM with its SiLU x mul, the logprob parts, the top-p draw) is built here for every
instruction set this CPU can run (x86-64-v2: the scalar code; v3: AVX2 and FMA; v4: AVX-512) and its
answers are compared bit for bit with the scalar build's."""

import ctypes
import platform
from contextlib import contextmanager

import pytest
import torch

from tokenmill.kernels.cpu import build, invariant_gemm, row_logprobs, row_sample

pytestmark = pytest.mark.skipif(build.find_compiler() is None or platform.machine() != "x86_64",
                                reason="needs a C compiler on x86-64")

# The x86-64 levels and the CPU flags a build for each needs to run.
LEVELS = {
    "scalar": ("-march=x86-64-v2", {"sse4_2", "popcnt"}),
    "avx2": ("-march=x86-64-v3", {"avx2", "fma", "bmi2", "f16c", "movbe"}),
    "avx512": ("-march=x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


RUNNABLE = [name for name, (_, needs) in LEVELS.items() if needs <= _cpu_flags()]


@contextmanager
def built_for(library: build.OnDemandLibrary, level: str):
    """The module's kernel library, for the duration, built with -march of `level` (the production
    flags otherwise)."""
    march = LEVELS[level][0]
    flags = [march if f == "-march=native" else f for f in build.FLAGS] + build.OPENMP_FLAGS
    target, error = build._compile(library.source, build.find_compiler(), flags)
    assert target is not None, error
    lib = ctypes.CDLL(str(target))
    library._declare(lib)
    saved = library._lib, library._settled
    library._lib, library._settled = lib, True
    try:
        yield
    finally:
        library._lib, library._settled = saved


def _per_level(library: build.OnDemandLibrary, compute) -> dict[str, list[torch.Tensor]]:
    out = {}
    for level in RUNNABLE:
        with built_for(library, level):
            out[level] = [t.clone() for t in compute()]
    return out


def _same_bits(results: dict[str, list[torch.Tensor]]) -> None:
    assert len(results) >= 2, f"only {list(results)} run on this CPU: nothing to compare"
    first, *others = results
    for level in others:
        for a, b in zip(results[first], results[level], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            same = a.view(torch.int32) == b.view(torch.int32) if a.dtype is torch.float32 else a == b
            assert bool(same.all()), f"{level} differs from {first} at {(~same).nonzero()[:5].tolist()}"


def _logits(rows: int, vocab: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * spread
    x[1, ::7] = float("-inf")  # masked ids (a constraint, min_tokens)
    x[2, 100:140] = x[2].max() + 1  # ties at the top
    x[3] = x[3].round()  # many equal logits
    return x


@pytest.mark.parametrize("vocab", [1000, 1031, 32000])
def test_logprob_parts_are_the_same_bits_in_every_instruction_set(vocab):
    x = _logits(9, vocab, seed=vocab)
    results = _per_level(row_logprobs._library, lambda: row_logprobs.logprob_parts(x, 5))
    _same_bits(results)
    assert torch.isfinite(results["scalar"][0]).all()


def test_a_row_holding_a_nan_is_told_apart_in_every_instruction_set():
    x = _logits(4, 1031, seed=1)
    x[1, 517] = float("nan")
    results = _per_level(row_logprobs._library, lambda: row_logprobs.logprob_parts(x, 3))
    for level, (log_total, _, _) in results.items():
        assert torch.isnan(log_total).tolist() == [False, True, False, False], level


@pytest.mark.parametrize("spread", [3.0, 0.3], ids=["peaked", "flat"])  # flat: a random model's rows
@pytest.mark.parametrize("vocab", [1031, 5000, 32000])
def test_top_p_draws_are_the_same_in_every_instruction_set(vocab, spread):
    x = _logits(12, vocab, seed=vocab, spread=spread)
    rows = torch.arange(12)
    temperatures = torch.tensor([0.8, 1.0, 0.5, 1.3] * 3)
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.1, 0.95] * 2)
    uniforms = torch.linspace(0.01, 0.99, 12, dtype=torch.float64)
    results = _per_level(row_sample._library, lambda: [row_sample.sample_rows(x, rows, temperatures, top_ps, uniforms)])
    _same_bits(results)
    assert (results["scalar"][0] >= 0).all()


@pytest.mark.parametrize("m", [1, 13, 40])
def test_the_fixed_order_gemm_is_the_same_bits_in_every_instruction_set(m):
    g = torch.Generator().manual_seed(m)
    weight, bias = torch.randn(70, 300, generator=g), torch.randn(70, generator=g)
    x, gate_up = torch.randn(m, 300, generator=g), torch.randn(m, 600, generator=g)

    def compute():
        # The packed layout is the build's own: pack within it.
        w = invariant_gemm.InvariantWeight(weight)
        return [w.linear(x), w.linear(x, bias), w.linear_silu_mul(gate_up)]

    _same_bits(_per_level(invariant_gemm._library, compute))
