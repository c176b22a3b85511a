"""The fixed-order GEMM of a batch-invariant engine (kernels/cpu/invariant_gemm.py): every output is one
fused multiply-add chain over k in order, so a row's bits are the same alone or among others, at any
row count, thread count, K block or row pass, and equal a plain loop of fmaf; its SiLU x mul gives an
element the same value wherever it sits. MKL's F.linear, for contrast, changes a row's bits with the
row count on this project's machines."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import invariant_gemm
from tokenmill.kernels.cpu.invariant_gemm import InvariantWeight, fma_chain_reference, silu_mul

pytestmark = pytest.mark.skipif(not invariant_gemm.available(), reason="no C compiler")


def _data(rows, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


def test_every_output_is_the_fma_chain_in_order_plus_the_bias():
    x, w, b = _data(13, 37, 21)
    packed = InvariantWeight(w)
    assert torch.equal(packed.linear(x), fma_chain_reference(x, w))
    assert torch.equal(packed.linear(x, b), fma_chain_reference(x, w) + b)
    torch.testing.assert_close(packed.linear(x, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert packed.linear(x[:0]).shape == (0, 21)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 32, 33, 47, 48, 80])
def test_every_tile_shape_gives_the_fma_chain(n):
    """Row counts 1 to 25 (every tile height of the AVX2 and AVX-512 kernels, and their remainders)
    against column counts that end in a full panel, a part-filled one, a pair of panels or one alone."""
    x, w, b = _data(25, 40, n, seed=4)
    packed = InvariantWeight(w)
    want = fma_chain_reference(x, w) + b
    for rows in range(1, 26):
        assert torch.equal(packed.linear(x[:rows], b), want[:rows]), rows


@pytest.mark.parametrize("k,n", [(256, 512), (688, 256), (96, 1000)])
def test_a_row_gets_the_same_bits_alone_among_others_and_at_any_thread_count(k, n):
    x, w, b = _data(600, k, n, seed=1)
    packed = InvariantWeight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = packed.linear(x, b)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for start, rows in ((0, 1), (5, 1), (0, 7), (3, 64), (100, 263), (0, 265), (0, 600), (599, 1)):
                assert torch.equal(packed.linear(x[start:start + rows], b), full[start:start + rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


def test_strided_rows_and_an_output_buffer_give_the_same_bits():
    x, w, _ = _data(40, 64, 50, seed=2)
    packed = InvariantWeight(w)
    wide = torch.zeros(40, 200)
    wide[:, 10:74] = x
    want = packed.linear(x)
    assert torch.equal(packed.linear(wide[:, 10:74]), want)
    out = torch.full((40, 50), float("nan"))
    assert packed.linear(x, out=out) is out and torch.equal(out, want)


def test_k_blocks_and_row_passes_do_not_change_a_bit(monkeypatch):
    """Cutting K hands the partial sums on through memory (an exact round trip), and rows in passes of
    any size are each still one chain per output."""
    x, w, b = _data(50, 300, 70, seed=3)
    packed = InvariantWeight(w)
    want = packed.linear(x, b)
    monkeypatch.setattr(invariant_gemm, "K_BLOCK", 16)
    assert torch.equal(packed.linear(x, b), want)
    monkeypatch.setattr(invariant_gemm, "ROW_PASS", 6)
    assert torch.equal(packed.linear(x, b), want)


def test_mkl_changes_a_rows_bits_with_the_row_count_and_the_fixed_order_kernel_does_not():
    """Why the kernel exists: F.linear (MKL) picks its summation order by shape."""
    x, w, _ = _data(256, 256, 512, seed=4)
    packed = InvariantWeight(w)
    full_mkl, full = F.linear(x, w), packed.linear(x)
    mkl_alone = [torch.equal(F.linear(x[i:i + 1], w), full_mkl[i:i + 1]) for i in range(0, 256, 8)]
    assert not all(mkl_alone)  # on this project's machines (MKL) most rows differ alone
    assert all(torch.equal(packed.linear(x[i:i + 1]), full[i:i + 1]) for i in range(0, 256, 8))


def test_silu_mul_gives_an_element_the_same_value_wherever_it_sits():
    g = torch.Generator().manual_seed(5)
    values = torch.randn(2, 101, generator=g) * 6  # gate, up
    want = silu_mul(torch.cat([values[0], values[1]])[None])[0]
    for offset in (1, 3, 8, 13):  # the same elements at other lanes and in the scalar tail
        gate = torch.cat([torch.zeros(offset), values[0]])
        up = torch.cat([torch.zeros(offset), values[1]])
        got = silu_mul(torch.cat([gate, up])[None])[0, offset:]
        assert torch.equal(got, want), offset
    # Close to torch's own SiLU x mul (a few ulp), never its bits by construction.
    torch.testing.assert_close(want, F.silu(values[0]) * values[1], atol=1e-6, rtol=1e-6)


def test_the_down_projection_takes_silu_mul_in_the_same_call():
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(45, 2 * 72, generator=g) * 3
    w = torch.randn(30, 72, generator=g) / 8
    packed = InvariantWeight(w)
    folded = packed.linear_silu_mul(gate_up)
    assert torch.equal(folded, packed.linear(silu_mul(gate_up)))
    assert all(torch.equal(packed.linear_silu_mul(gate_up[i:i + 1]), folded[i:i + 1]) for i in range(45))
    torch.testing.assert_close(folded, F.linear(F.silu(gate_up[:, :72]) * gate_up[:, 72:], w), atol=1e-5, rtol=1e-5)
