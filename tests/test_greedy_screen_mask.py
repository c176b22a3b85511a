"""The greedy screen under a constraint's mask, on any CPU: its candidate search (the C kernel) over a
screen whose disallowed ids are -inf gives the full float32 head's argmax over the allowed ids.

The screen here is the bfloat16 product computed exactly the way the bound of
kernels/cpu/greedy_screen.py describes it (bfloat16 operands, exact products summed in float32, the
sum rounded to bfloat16), so the kernel runs on CPUs without oneDNN's bfloat16 GEMM too;
tests/test_greedy_head.py runs the whole screen, oneDNN's GEMM included, where the CPU has one."""

import pytest
import torch

from tokenmill.engine.sampler import greedy_argmax
from tokenmill.engine.structured.cpu_mask import apply_bitmask
from tokenmill.kernels.cpu import gemm, greedy_screen

pytestmark = pytest.mark.skipif(not gemm.available() or greedy_screen._library.get() is None,
                                reason="needs torch's oneDNN float32 GEMM and a C compiler")


def _screen_ids(screen: greedy_screen.GreedyScreen, hidden: torch.Tensor, approx: torch.Tensor,
                bitmask: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    ids = torch.empty(hidden.shape[0], dtype=torch.int64)
    cand = torch.empty(hidden.shape[0], dtype=torch.int64)
    screen._lib.greedy_from_screen(
        approx.data_ptr(), approx.stride(0), hidden.data_ptr(), hidden.stride(0), screen.weight.data_ptr(),
        screen.vocab, screen.hidden, screen.k_block, screen.col_bf16_norm.data_ptr(), screen.col_rest.data_ptr(),
        screen.col_bf16_norm_max, screen.col_rest_max, screen.gamma, screen.d_rel, screen.abs_term, screen.w_max,
        greedy_screen.MAX_CANDIDATES, hidden.shape[0], ids.data_ptr(), cand.data_ptr(),
        None if bitmask is None else bitmask.data_ptr(), 0 if bitmask is None else bitmask.shape[1],
        None if rows is None else rows.data_ptr(), None)
    return ids, cand


@pytest.mark.parametrize("kind", ["forced", "few", "most"])
def test_a_masked_screen_gives_the_full_heads_argmax_over_the_allowed_ids(kind):
    vocab, hidden_size, rows = 4096, 256, 48
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.02
    packed = gemm.pack(weight)
    def full_head(rows: torch.Tensor) -> torch.Tensor:
        return gemm.linear(rows, weight, None, packed)

    k_block = greedy_screen._find_k_block(greedy_screen._library.get(), weight, full_head)
    assert k_block is not None
    screen = greedy_screen.GreedyScreen(weight, None, k_block, greedy_screen._library.get())
    x = torch.randn(rows, hidden_size, generator=g)
    approx = (x.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().T).to(torch.bfloat16)
    full = full_head(x)
    # Masks: one allowed id, a few dozen, or all but a few; the full head's own argmax disallowed.
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        if kind == "forced":
            allowed[r, torch.randint(0, vocab, (1,), generator=g)] = True
        elif kind == "few":
            allowed[r, torch.randint(0, vocab, (40,), generator=g)] = True
        else:
            allowed[r] = torch.rand(vocab, generator=g) > 0.05
        allowed[r, full[r].argmax()] = False
    words = (allowed.view(rows, -1, 32).long() << torch.arange(32)).sum(dim=2)  # bit j: id 32 w + j
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    want = greedy_argmax(full.masked_fill(~allowed, float("-inf")))
    # The kernel reading the bitmask itself (the engine's way), the screen left as it is; every other
    # row through a bitmask row of its own in reverse order, the rest unconstrained.
    which = torch.tensor([rows - 1 - r if r % 2 == 0 else -1 for r in range(rows)])
    ids, cand = _screen_ids(screen, x, approx.clone(), bitmask.flip(0).contiguous(), which)
    assert torch.equal(ids[::2], want[::2])
    assert torch.equal(ids[1::2], greedy_argmax(full[1::2]))
    # The same as the screen masked first (disallowed ids -inf on it).
    apply_bitmask(approx, bitmask)
    ids, cand = _screen_ids(screen, x, approx)
    assert torch.equal(ids, want)
    assert bool((cand > 0).all()) and bool((cand <= greedy_screen.MAX_CANDIDATES).all())
    assert bool(allowed[torch.arange(rows), ids].all())


def test_ids_past_the_bitmask_are_disallowed():
    """A bitmask narrower than the vocabulary (a padded vocabulary) allows none of the ids past it."""
    vocab, hidden_size, rows = 1024, 64, 8
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.02
    weight[1000:] *= 50  # the ids past the bitmask hold every row's largest logits
    packed = gemm.pack(weight)
    k_block = greedy_screen._find_k_block(greedy_screen._library.get(), weight,
                                          lambda r: gemm.linear(r, weight, None, packed))
    screen = greedy_screen.GreedyScreen(weight, None, k_block, greedy_screen._library.get())
    x = torch.randn(rows, hidden_size, generator=g)
    approx = (x.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().T).to(torch.bfloat16)
    full = gemm.linear(x, weight, None, packed)
    assert bool((full.argmax(dim=1) >= 992).all())
    bitmask = torch.full((rows, 31), -1, dtype=torch.int32)  # ids 0 ... 991
    ids, _ = _screen_ids(screen, x, approx, bitmask, torch.arange(rows))
    assert torch.equal(ids, greedy_argmax(full[:, :992]))
