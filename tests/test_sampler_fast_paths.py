"""The sampler's shortcuts give what the long way gives, bit for bit: the raw logprobs' normaliser and
top-N from block maxima, greedy rows with logprobs taken by their argmax, and top-p's cut for rows
whose mass lies beyond the first candidates (flat distributions) found over the whole sorted row at
once, with or without the filters before it, in batches that mix flat and peaked rows."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingInputs,
    _row_logsumexp,
    _top_p_cutoff,
    raw_logprob_parts,
)
from tokenmill.engine.types import SamplingParams


def _rows(n: int, vocab: int, seed: int = 0, flat: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * (0.3 if flat else 4.0)
    return x


@pytest.mark.parametrize("vocab", [300, 1000, 32000, 32003])
@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
def test_logprob_parts_are_the_full_rows(vocab, top_n):
    x = _rows(9, vocab, seed=vocab, flat=False)
    before = x.clone()
    log_total, top_vals, top_idx = raw_logprob_parts(x, top_n)
    assert torch.equal(x, before)  # nothing written
    row_max = x.amax(dim=1, keepdim=True)
    want_total = (row_max + (x - row_max).exp().sum(dim=1, keepdim=True).log()).squeeze(1)
    assert torch.equal(log_total, want_total)
    want_vals, want_idx = x.topk(top_n, dim=1)
    assert torch.equal(top_vals, want_vals) and torch.equal(top_idx, want_idx)


def test_greedy_rows_with_logprobs_are_the_generic_paths_tokens_and_logprobs():
    x = _rows(12, 5000, seed=3, flat=False)
    inputs = [SamplingInputs(SamplingParams(temperature=0.0, logprobs=(i % 3) * 2 or None), [1], [], [2])
              for i in range(12)]
    got = Sampler(0)(x.clone(), inputs)
    # The generic path: one sampled row in the batch sends every row through it.
    mixed = [*inputs, SamplingInputs(SamplingParams(temperature=0.7, seed=5), [1], [], [2])]
    want = Sampler(0)(torch.cat([x, x[:1]]), mixed)[:12]
    assert [(s.token_id, s.logprob, s.top_logprobs) for s in got] == [
        (s.token_id, s.logprob, s.top_logprobs) for s in want]
    assert got[1].logprob is not None and len(got[1].top_logprobs) == 2


@pytest.mark.parametrize("floored", [False, True])
def test_flat_rows_cut_over_the_whole_row_as_the_long_way(floored):
    """Flat rows (a random model's) take the whole sorted row at once, peaked rows the candidates
    first; every cut equals the one found over the whole sorted row."""
    vocab = 4000
    x = torch.cat([_rows(5, vocab, seed=1, flat=True), _rows(5, vocab, seed=2, flat=False)])
    x = x[torch.randperm(10, generator=torch.Generator().manual_seed(9))]
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.2, 0.95, 0.9, 0.7, 0.3, 0.8, 0.6])
    earlier = torch.full((10,), float("-inf"))
    marks = [floored and i % 2 == 0 for i in range(10)]
    if floored:
        earlier = torch.where(torch.tensor(marks), x.quantile(0.1, dim=1), earlier)
    fast = _top_p_cutoff(x, top_p, earlier, marks, TOP_P_CANDIDATES)
    whole = _top_p_cutoff(x, top_p, earlier, marks, vocab)
    assert torch.equal(fast, whole)
    # and the cut is where the mass reaches top_p: tokens kept hold at least top_p of it
    log_total = _row_logsumexp(x, earlier, marks)
    kept = ((x - log_total.unsqueeze(1)).exp() * (x >= torch.maximum(fast, earlier).unsqueeze(1))).sum(dim=1)
    assert bool((kept >= top_p - 1e-4).all())


def test_seeded_top_p_draws_on_flat_rows_are_those_of_the_whole_sorted_row(monkeypatch):
    """The sampler's draws with the shortcut equal those with every row cut over its whole sorted row."""
    import tokenmill.engine.sampler as sampler

    x = _rows(16, 32000, seed=4, flat=True)
    inputs = [SamplingInputs(SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i), [1], [3] * i, [2])
              for i in range(16)]
    fast = Sampler(0).sample_ids(x.clone(), inputs)
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 32000)  # every row sorted whole from the start
    assert torch.equal(Sampler(0).sample_ids(x.clone(), inputs), fast)


def test_penalties_over_many_rows_are_each_rows_own():
    """All penalised rows' positions are built at once: each row's tokens are penalised in its own
    row as a one-row batch penalises them, and an id outside the vocabulary is still refused."""
    vocab = 3000
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, vocab, generator=g) * 3
    inputs = [SamplingInputs(SamplingParams(temperature=0.0, repetition_penalty=1.0 + 0.05 * (i % 4),
                                            frequency_penalty=0.5 * (i % 3), presence_penalty=0.3 * (i % 2)),
                             torch.randint(0, vocab, (5 + i,), generator=g).tolist(),
                             # each row's best token among its outputs, so the penalties bite
                             [*torch.randint(0, vocab, (i,), generator=g).tolist(), int(x[i].argmax())], [2])
              for i in range(40)]
    together = Sampler(0).sample_ids(x.clone(), inputs)
    alone = torch.cat([Sampler(0).sample_ids(x[i : i + 1].clone(), [inputs[i]]) for i in range(40)])
    assert torch.equal(together, alone)
    assert not torch.equal(together, x.argmax(dim=1))  # the penalties changed some rows' tokens
    bad = [*inputs[:3], SamplingInputs(SamplingParams(temperature=0.0, presence_penalty=1.0), [1], [vocab], [2])]
    with pytest.raises(ValueError, match="output token ids must be in"):
        Sampler(0).sample_ids(x[:4].clone(), bad)
