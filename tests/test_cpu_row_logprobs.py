"""The C logprob parts (kernels/cpu/row_logprobs.py): each row's logsumexp close to float64's, its
top-N exactly torch's, a row's bits the same alone, in any batch and at any thread count, odd rows
(NaN, no finite maximum) handed to torch, and the sampler's logprobs with the kernel equal to its
torch path's within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import Sampler, SamplingInputs, raw_logprob_parts
from tokenmill.engine.types import SamplingParams
from tokenmill.kernels.cpu import row_logprobs

pytestmark = pytest.mark.skipif(not row_logprobs.available(), reason="needs a C compiler")


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different spreads: flat ones (a random model's) and peaked ones (a trained model's).
    return torch.randn(rows, vocab, generator=g) * torch.logspace(-1, 1.3, rows).unsqueeze(1)


@pytest.mark.parametrize("vocab", [7, 31, 32, 1000, 32003])
def test_the_normaliser_is_float64s_and_the_top_n_is_torchs(vocab):
    x = _logits(37, vocab)
    top_n = min(5, vocab)
    log_total, top_vals, top_ids = row_logprobs.logprob_parts(x, top_n)
    want = torch.logsumexp(x.double(), dim=1)
    assert (log_total.double() - want).abs().max().item() <= 4e-6 * want.abs().max().item() + 1e-6
    ref_vals, ref_ids = x.topk(top_n, dim=1)
    assert torch.equal(top_vals, ref_vals) and torch.equal(top_ids, ref_ids)


def test_a_row_gets_the_same_bits_alone_in_a_batch_and_at_any_thread_count():
    x = _logits(64, 32000, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_logprobs.logprob_parts(x, 4)
        torch.set_num_threads(2)
        two = row_logprobs.logprob_parts(x, 4)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    for r in (0, 17, 63):
        alone = row_logprobs.logprob_parts(x[r : r + 1].clone(), 4)
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, one, strict=True))
    # A strided view (a batch's rows picked out) reads the same bits.
    wide = torch.zeros(64, 32100)
    wide[:, :32000] = x
    strided = row_logprobs.logprob_parts(wide[:, :32000], 4)
    assert all(torch.equal(a, b) for a, b in zip(strided, one, strict=True))


def test_odd_rows_are_flagged_and_raw_logprob_parts_gives_them_torchs_answer():
    x = _logits(6, 300)
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3, 9] = float("inf")
    x[4, :200] = float("-inf")  # masked ids: the row is still the kernel's
    log_total, _, _ = row_logprobs.logprob_parts(x, 3)
    assert torch.isnan(log_total[1:4]).all() and torch.isfinite(log_total[[0, 4, 5]]).all()
    got = raw_logprob_parts(x, 3, c_kernel=True)
    want = raw_logprob_parts(x, 3)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(got[2][[0, 4, 5]], want[2][[0, 4, 5]])


def test_the_sampler_with_the_kernel_gives_the_same_tokens_and_logprobs_within_rounding():
    x = _logits(48, 5000, seed=5)
    inputs = [SamplingInputs(params=SamplingParams(max_tokens=4, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                   logprobs=i % 6), prompt_token_ids=[1, 2], output_token_ids=[],
                             eos_token_ids=[0])
              for i in range(48)]
    plain = Sampler(seed=1)(x.clone(), inputs)
    fast = Sampler(seed=1, cpu_kernels=True)(x.clone(), inputs)
    assert [t.token_id for t in fast] == [t.token_id for t in plain]
    for a, b in zip(fast, plain, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-5)
        assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs], abs=2e-5)


@pytest.mark.parametrize("top", [0, 1, 5])
def test_greedy_rows_with_logprobs_take_their_argmax_from_the_kernels_top_n_lowest_id_on_ties(top):
    x = _logits(24, 3000, seed=7)
    x[3, [10, 400, 2999]] = x[3].max() + 1  # a three-way tie for the maximum: the lowest id wins
    x[5, :] = 0.25  # every logit equal
    x[7, 1500:] = float("-inf")  # masked ids
    inputs = [SamplingInputs(params=SamplingParams(max_tokens=4, temperature=0.0, logprobs=top),
                             prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0]) for _ in range(24)]
    fast = Sampler(seed=0, cpu_kernels=True)(x.clone(), inputs)
    plain = Sampler(seed=0)(x.clone(), inputs)
    assert [t.token_id for t in fast] == x.argmax(dim=1).tolist() == [t.token_id for t in plain]
    assert fast[3].token_id == 10 and fast[5].token_id == 0
    for r, (a, b) in enumerate(zip(fast, plain, strict=True)):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-5)
        if r not in (3, 5):  # among equal logits torch's topk keeps no id order
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
    # The kernel's top-N keeps the lowest ids first among equal logits.
    assert [i for i, _ in fast[3].top_logprobs][:3] == [10, 400, 2999][:top]
    assert [i for i, _ in fast[5].top_logprobs] == list(range(top))
    # A row that is not finite sends the whole step down the argmax path: the same tokens.
    x[9, 4] = float("nan")
    odd = Sampler(seed=0, cpu_kernels=True)(x.clone(), inputs)
    assert [t.token_id for t in odd] == [t.token_id for t in Sampler(seed=0)(x.clone(), inputs)]


def test_an_engine_with_cpu_sampling_off_gives_the_same_tokens_and_logprobs_within_rounding(tiny_llama_dir):
    from tokenmill.engine import Engine, EngineConfig, EngineRequest

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (3, 20, 41)]

    def run(setting: str):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02,
                                     cpu_sampling=setting))
        assert engine.sampler.cpu_kernels is (setting == "auto")
        res = engine.generate([EngineRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i))
            for i, p in enumerate(prompts)])
        return {rid: (d.output_token_ids, [lp.logprob for lp in d.output_logprobs]) for rid, d in res.items()}

    on, off = run("auto"), run("off")
    assert {rid: ids for rid, (ids, _) in on.items()} == {rid: ids for rid, (ids, _) in off.items()}
    for rid, (_, logprobs) in on.items():
        assert logprobs == pytest.approx(off[rid][1], abs=2e-5)


def test_a_rows_logprobs_have_the_same_bits_whether_its_step_takes_the_fused_argmax_or_not():
    """A step whose greedy rows all want logprobs takes their argmax from the kernel's top-N; a step
    with one row that wants none takes greedy_argmax and the kernel after. A row's token and every
    logprob must not depend on which: batch invariance."""
    x = _logits(16, 4000, seed=9)
    x[2, [5, 77]] = x[2].max() + 0.5  # a tie for the maximum
    def inputs(none_at: int | None):
        return [SamplingInputs(params=SamplingParams(max_tokens=4, temperature=0.0,
                                                     logprobs=None if i == none_at else 3),
                               prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0]) for i in range(16)]
    fused = Sampler(seed=0, cpu_kernels=True)(x.clone(), inputs(None))
    split = Sampler(seed=0, cpu_kernels=True)(x.clone(), inputs(15))
    alone = [Sampler(seed=0, cpu_kernels=True)(x[r : r + 1].clone(), inputs(None)[:1])[0] for r in range(15)]
    for r in range(15):
        assert fused[r].token_id == split[r].token_id == alone[r].token_id
        assert fused[r].logprob == split[r].logprob == alone[r].logprob  # bits, not rounding
        assert fused[r].top_logprobs == split[r].top_logprobs == alone[r].top_logprobs
    assert fused[2].token_id == 5


def test_a_step_with_no_rows_samples_nothing():
    assert Sampler(seed=0, cpu_kernels=True)(torch.empty(0, 300), []) == []
