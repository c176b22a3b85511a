"""The CPU token mask (worker/engine/structured/cpu_mask.py) against the plain-torch reference of
kernels/token_bitmask.py: the masked argmax is greedy_argmax of the masked logits (ties, rows with
nothing allowed, a vocabulary past the mask or not a multiple of 32, picked rows) without writing
them, and the apply writes exactly the reference's -inf; a step's mask (StepMask) gives the same
through every use: the sampler's argmax and apply, forked rows, a part of a step in parts."""

from concurrent.futures import Future

import pytest
import torch

from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.sampler import greedy_argmax
from tokenmill.engine.structured.constraints import StepMask
from tokenmill.engine.structured.cpu_mask import HEAVY_ROW_WORDS, apply_bitmask, masked_argmax
from tokenmill.kernels.token_bitmask import apply_token_bitmask_ref


def _random_words(shape, g):
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def _mask(rows: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Masks as grammars make them: `forced` rows allow one token, `string` rows all but a few ids
    in every word (a JSON string: no quote, backslash or control character), `runs` whole words
    allowed or not with a few mixed, `random` any bits."""
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    if kind == "random":
        return _random_words((rows, words), g)
    if kind == "forced":
        mask = torch.zeros(rows, words, dtype=torch.int32)
        ids = torch.randint(0, vocab, (rows,), generator=g)
        for r, t in enumerate(ids.tolist()):
            mask[r, t // 32] = torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
        return mask
    if kind == "string":
        holes = torch.randint(0, 32, (rows, words), generator=g)
        return (~(torch.ones_like(holes) << holes)).to(torch.int32) | torch.where(holes == 0, 0, 1).to(torch.int32)
    choice = torch.randint(0, 3, (rows, words), generator=g)
    mask = torch.where(choice == 0, 0, -1).to(torch.int32)
    return torch.where(choice == 2, _random_words((rows, words), g), mask)


def _want_argmax(logits, mask, rows=None):
    masked = logits.clone()
    apply_token_bitmask_ref(masked, mask, rows)
    return greedy_argmax(masked)


KINDS = ["random", "forced", "string", "runs"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [64, 100, 2048, 2053])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(kind, vocab):
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab))
    mask = _mask(7, vocab, kind, seed=vocab)
    before = logits.clone()
    assert torch.equal(masked_argmax(logits, mask), _want_argmax(logits, mask))
    assert torch.equal(logits, before)  # nothing written


def test_rows_whose_best_token_is_disallowed_search_their_words_and_many_words_are_pruned():
    """A string row whose largest logit is a quote: the best allowed id comes from the words left
    after pruning (rows with more than HEAVY_ROW_WORDS non-zero words), equal to the reference."""
    vocab = 32 * (HEAVY_ROW_WORDS * 4)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab, generator=g)
    mask = _mask(6, vocab, "string", seed=1)
    for r in range(6):  # the row's maximum on an id its mask disallows
        word = int(torch.randint(0, vocab // 32, (1,), generator=g))
        bits = int(mask[r, word]) & 0xFFFFFFFF
        hole = next(j for j in range(32) if not (bits >> j) & 1)
        logits[r, 32 * word + hole] = 50.0
    assert torch.equal(masked_argmax(logits, mask), _want_argmax(logits, mask))


def test_ties_go_to_the_lowest_allowed_id():
    logits = torch.zeros(3, 96)
    logits[:, [5, 40, 70]] = 2.0
    mask = torch.full((3, 3), -1, dtype=torch.int32)
    mask[0, 0] = 0  # id 5 disallowed: 40 is the lowest allowed maximum
    mask[1, 0] = ~torch.tensor(1 << 5, dtype=torch.int32)  # only id 5 of word 0 disallowed
    mask[2] = 0
    mask[2, 2] = 1 << 6  # only id 70
    assert masked_argmax(logits, mask).tolist() == [40, 40, 70] == _want_argmax(logits, mask).tolist()


def test_nothing_allowed_and_ids_past_the_mask():
    logits = torch.randn(3, 100)
    mask = torch.zeros(3, 2, dtype=torch.int32)  # covers ids 0-63; 64-99 past it: disallowed
    mask[1, 1] = 1 << 3
    mask[2, 0] = -1
    logits[2, 90] = 100.0  # past the mask: never chosen
    assert torch.equal(masked_argmax(logits, mask), _want_argmax(logits, mask))
    assert masked_argmax(logits, mask)[0] == 0  # the argmax of an all -inf row


def test_picked_rows_and_unmasked_rows():
    logits = torch.randn(6, 160)
    mask = _mask(3, 160, "forced", seed=3)
    rows = torch.tensor([1, 3, 4])
    got = masked_argmax(logits, mask, rows)
    assert torch.equal(got, _want_argmax(logits, mask, rows))
    assert got[0] == logits[0].argmax()  # a row without a mask row: its plain argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [64, 100, 2053])
def test_apply_writes_exactly_the_references_minus_infinity(dtype, kind, vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    mask = _mask(5, vocab, kind, seed=vocab + 1)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask)
    apply_bitmask(got, mask)
    assert torch.equal(got, want)
    rows = torch.tensor([0, 2, 4])
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask[:3], rows)
    apply_bitmask(got, mask[:3], rows)
    assert torch.equal(got, want)


def _step_mask(bitmask, rows, metrics, fill_s=0.25):
    done = Future()
    done.set_result(fill_s)
    return StepMask(done, bitmask, rows, metrics)


def test_a_step_mask_gives_the_same_through_every_use_and_one_metrics_entry():
    vocab = 256
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7))
    bitmask = _mask(3, vocab, "runs", seed=7)
    rows = [1, 2, 4]  # sampling rows 0, 3 and 5 are not constrained
    metrics = EngineMetrics()
    step = _step_mask(bitmask, rows, metrics)
    step.repeat_row(2, 5)  # a forked choice in row 5 samples under row 2's mask
    want = logits.clone()
    apply_token_bitmask_ref(want, torch.cat([bitmask, bitmask[1:2]]), torch.tensor([1, 2, 4, 5]))
    assert torch.equal(step.argmax(logits), greedy_argmax(want))
    whole = logits.clone()
    step.apply(whole)
    assert torch.equal(whole, want)
    # A step in parts: rows 3-5 are one part, masked with their own rows of the mask.
    part = logits[3:].clone()
    step.apply(part, first_row=3)
    assert torch.equal(part, want[3:])
    assert len(metrics.mask_s) == len(metrics.mask_rows) == 1  # the fill and three uses: one step
    assert metrics.mask_rows == [4] and metrics.mask_s[0] >= 0.25
