"""The C draw of sampled rows (kernels/cpu/row_sample.py): the torch path's token for the same uniform
on flat and peaked rows, top_p from 0.3 to nearly 1, masked ids never drawn, a row's draw the same
alone, in a batch and at any thread count, odd rows handed back, and the sampler with the kernel
giving the tokens of its torch path, rows with top_k or min_p among them."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import Sampler, SamplingInputs, _inverse_cdf
from tokenmill.engine.types import SamplingParams
from tokenmill.kernels.cpu import row_sample

pytestmark = pytest.mark.skipif(not row_sample.available(), reason="needs a C compiler")


def _inputs(params: list[SamplingParams]) -> list[SamplingInputs]:
    return [SamplingInputs(params=p, prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0]) for p in params]


@pytest.mark.parametrize(("spread", "top_p", "vocab"), [
    (0.3, 0.9, 32000),  # flat: a random model's rows, the cut deep in the row
    (4.0, 0.9, 32000),  # peaked: a trained model's
    (4.0, 0.99999, 32000),  # the cut past the first level's 8 nats
    (1.0, 1.0, 32003),  # temperature alone
    (2.0, 0.5, 1000),
    (0.01, 0.3, 50),
])
def test_the_draw_is_the_torch_paths_for_the_same_uniform(spread, top_p, vocab):
    g = torch.Generator().manual_seed(int(spread * 100) + vocab)
    rows = 96
    x = torch.randn(rows, vocab, generator=g) * spread
    x[:6, : vocab // 2] = float("-inf")  # masked ids (a constraint, min_tokens)
    processed = Sampler(seed=0)._process(x.clone(), _inputs(
        [SamplingParams(max_tokens=4, temperature=0.8, top_p=top_p, seed=i) for i in range(rows)]))
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    want = _inverse_cdf(processed.random_weights.clone(), u)
    got = row_sample.sample_rows(x, torch.arange(rows), torch.full((rows,), 0.8), torch.full((rows,), top_p), u)
    # The kernel sums in double where torch's cumulative sum rounds in float32, so a uniform within
    # rounding of a token's edge may take the next kept token: rarely, and only ever a neighbour.
    differ = (got != want).nonzero().squeeze(1).tolist()
    assert len(differ) <= 2, differ
    for r in differ:
        kept = (processed.random_weights[r] > 0).nonzero().squeeze(1).tolist()
        assert abs(kept.index(int(got[r])) - kept.index(int(want[r]))) == 1
    assert bool((got[:6] >= vocab // 2).all())
    # The extremes of u: the first and the last kept token.
    ends = row_sample.sample_rows(x, torch.tensor([7, 7]), torch.full((2,), 0.8), torch.full((2,), top_p),
                                  torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    kept = (processed.random_weights[7] > 0).nonzero().squeeze(1)
    assert ends.tolist() == [int(kept[0]), int(kept[-1])]


def test_a_rows_draw_is_the_same_alone_in_a_batch_and_at_any_thread_count():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32000, generator=g) * torch.logspace(-1, 0.7, 64).unsqueeze(1)
    temps, top_ps = torch.linspace(0.5, 1.3, 64), torch.linspace(0.5, 1.0, 64)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_sample.sample_rows(x, torch.arange(64), temps, top_ps, u)
        torch.set_num_threads(2)
        two = row_sample.sample_rows(x, torch.arange(64), temps, top_ps, u)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for r in (0, 31, 63):
        alone = row_sample.sample_rows(x[r : r + 1].clone(), torch.tensor([0]), temps[r : r + 1], top_ps[r : r + 1],
                                       u[r : r + 1])
        assert int(alone) == int(one[r])


def test_odd_rows_come_back_and_the_sampler_draws_them_with_torch():
    x = torch.randn(4, 500)
    x[1, 3] = float("nan")
    x[2] = float("-inf")
    got = row_sample.sample_rows(x, torch.arange(4), torch.ones(4), torch.full((4,), 0.9),
                                 torch.full((4,), 0.5, dtype=torch.float64))
    assert got[1] == -1 and got[2] == -1 and got[0] >= 0 and got[3] >= 0
    y = torch.randn(3, 500)
    y[1, 9] = float("nan")
    inputs = _inputs([SamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, seed=s) for s in range(3)])
    fast = Sampler(seed=0, cpu_kernels=True)._token_ids(y.clone(), inputs)
    plain = Sampler(seed=0)._token_ids(y.clone(), inputs)
    assert fast[[0, 2]].tolist() == plain[[0, 2]].tolist()


def test_the_sampler_with_the_kernel_gives_its_torch_paths_tokens():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 4000, generator=g) * 2
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.1), dict(temperature=0.0),
             dict(temperature=0.9, top_k=40, top_p=0.95), dict(temperature=0.7, min_p=0.05),
             dict(temperature=1.0, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.4)]
    params = [SamplingParams(max_tokens=8, seed=i, **kinds[i % len(kinds)]) for i in range(40)]
    inputs = [SamplingInputs(params=p, prompt_token_ids=[5, 6, 7], output_token_ids=[int(i) for i in range(3)],
                             eos_token_ids=[0]) for p in params]
    fast = Sampler(seed=0, cpu_kernels=True)._token_ids(x.clone(), inputs)
    plain = Sampler(seed=0)._token_ids(x.clone(), inputs)
    assert torch.equal(fast, plain)
