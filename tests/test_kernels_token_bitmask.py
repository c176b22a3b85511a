"""Token bitmask kernels (structured output): the Triton kernel (under the interpreter) and the CPU
path equal the plain-torch reference, on random masks, run-shaped masks, picked rows and a
vocabulary that is not a multiple of 32."""

import pytest
import torch

from tokenmill.kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_cpu,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
)


def _mask(rows: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    if kind == "random":
        return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    # Runs, as grammars make them: whole words allowed or not, a few mixed words.
    choice = torch.randint(0, 3, (rows, words), generator=g)
    mask = torch.where(choice == 0, 0, -1).to(torch.int32)
    mixed = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.where(choice == 2, mixed, mask)


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = [(int(w) >> j) & 1 for row in mask.tolist() for w in row for j in range(32)]
    return torch.tensor(bits, dtype=torch.bool).view(mask.shape[0], -1)[:, :vocab]


@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("vocab", [96, 100, 1000])
def test_reference_masks_exactly_the_zero_bits(kind, vocab):
    logits = torch.randn(3, vocab)
    mask = _mask(3, vocab, kind)
    out = logits.clone()
    apply_token_bitmask_ref(out, mask)
    allowed = _allowed(mask, vocab)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()


@pytest.mark.parametrize("path", [apply_token_bitmask_cpu, apply_token_bitmask_triton], ids=["cpu", "triton"])
@pytest.mark.parametrize("kind", ["random", "runs"])
@pytest.mark.parametrize("vocab", [64, 100, 2048, 2053])
def test_paths_equal_the_reference(path, kind, vocab):
    logits = torch.randn(5, vocab)
    mask = _mask(5, vocab, kind, seed=vocab)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask)
    path(got, mask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", [apply_token_bitmask_cpu, apply_token_bitmask_triton], ids=["cpu", "triton"])
def test_picked_rows_only(path):
    logits = torch.randn(6, 160)
    mask = _mask(2, 160, "runs", seed=3)
    rows = torch.tensor([1, 4])
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask, rows)
    path(got, mask, rows)
    assert torch.equal(got, want)
    untouched = [0, 2, 3, 5]
    assert torch.equal(got[untouched], logits[untouched])


def test_ids_past_the_mask_are_disallowed():
    """A padded vocabulary wider than the mask: the ids it does not cover are masked."""
    logits = torch.zeros(1, 70)
    mask = torch.full((1, 2), -1, dtype=torch.int32)  # covers ids 0..63, all allowed
    for path in (apply_token_bitmask_ref, apply_token_bitmask_cpu, apply_token_bitmask_triton):
        out = logits.clone()
        path(out, mask)
        assert torch.isneginf(out[0, 64:]).all() and not torch.isinf(out[0, :64]).any()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="pass rows"):
        apply_token_bitmask(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32))
