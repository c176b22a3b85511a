"""The batched sampler against a plain per-row reference, plus seeding and distribution checks."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from tokenmill.engine.sampler import (
    Sampler,
    SamplingInputs,
    _inverse_cdf,
    greedy_argmax,
    seeded_uniform,
)
from tokenmill.engine.types import SamplingParams

VOCAB = 64
EOS = [5, 7]
NEG_INF = float("-inf")


# -- a deliberately simple reference: one row at a time, Python loops over the vocabulary ----------


def reference_distribution(row: torch.Tensor, inp: SamplingInputs) -> list[float]:
    p = inp.params
    x = [float(v) for v in row]
    if len(inp.output_token_ids) < p.min_tokens:
        blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else list(inp.eos_token_ids))
        for t in blocked:
            x[t] = NEG_INF
    if p.repetition_penalty != 1.0:
        for t in set(inp.prompt_token_ids) | set(inp.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(inp.output_token_ids).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.temperature < 1e-5:
        best = max(range(len(x)), key=lambda t: (x[t], -t))  # lowest id among the maxima
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    x = [v / p.temperature for v in x]

    def softmax(vals):
        m = max(vals)
        e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in vals]
        s = sum(e)
        return [v / s for v in e]

    if p.min_p > 0:
        probs = softmax(x)
        top = max(probs)
        x = [NEG_INF if probs[t] < p.min_p * top else x[t] for t in range(len(x))]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [NEG_INF if v < kth else v for v in x]
    if p.top_p < 1.0:
        # Walk down the distribution while the mass so far is below top_p; every token whose logit
        # reaches the last one walked over stays (ties included).
        probs = softmax(x)
        mass, cutoff = 0.0, None
        for t in sorted(range(len(x)), key=lambda t: -x[t]):
            if mass >= p.top_p:
                break
            cutoff = x[t]
            mass += probs[t]
        x = [v if v >= cutoff else NEG_INF for v in x]
    return softmax(x)


def reference_draw(probs: list[float], u: float) -> int:
    total = sum(probs)
    acc = 0.0
    for t, q in enumerate(probs):
        acc += q
        if acc > u * total:
            return t
    return max(t for t, q in enumerate(probs) if q > 0)


def make_inputs(params: SamplingParams, rng: random.Random, n_prompt=12, n_out=6) -> SamplingInputs:
    return SamplingInputs(
        params=params,
        prompt_token_ids=[rng.randrange(VOCAB) for _ in range(n_prompt)],
        output_token_ids=[rng.randrange(VOCAB) for _ in range(n_out)],
        eos_token_ids=EOS,
    )


def random_logits(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


FIELD_CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_k_1": dict(temperature=1.0, top_k=1),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "repetition": dict(temperature=1.0, repetition_penalty=1.7),
    "repetition_below_1": dict(temperature=1.0, repetition_penalty=0.6),
    "presence": dict(temperature=1.0, presence_penalty=1.5),
    "frequency": dict(temperature=1.0, frequency_penalty=-0.8),
    "min_tokens": dict(temperature=1.0, min_tokens=50, stop_token_ids=[3, 9]),
    "min_tokens_ignore_eos": dict(temperature=1.0, min_tokens=50, stop_token_ids=[3], ignore_eos=True),
    "greedy_penalised": dict(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "all": dict(
        temperature=0.9,
        top_k=12,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        min_tokens=10,
        stop_token_ids=[1],
    ),
}


@pytest.mark.parametrize("name", sorted(FIELD_CASES))
def test_each_field_matches_reference(name):
    rng = random.Random(name)
    n = 24
    logits = random_logits(n, seed=len(name))
    inputs = [make_inputs(SamplingParams(seed=1000 + i, **FIELD_CASES[name]), rng) for i in range(n)]
    sampler = Sampler(seed=0)

    dist = sampler.distribution(logits, inputs)
    tokens = sampler(logits, inputs)
    for i, inp in enumerate(inputs):
        want = reference_distribution(logits[i], inp)
        assert dist[i].tolist() == pytest.approx(want, abs=2e-6), f"row {i}"
        u = seeded_uniform(inp.params.seed, len(inp.output_token_ids))
        assert tokens[i].token_id == reference_draw(want, u), f"row {i}"
        assert want[tokens[i].token_id] > 0


def test_mixed_batch_matches_reference():
    rng = random.Random(7)
    n = 40
    logits = random_logits(n, seed=3)
    cases = list(FIELD_CASES.values())
    inputs = [
        make_inputs(
            SamplingParams(seed=rng.randrange(1 << 40), **rng.choice(cases)), rng, n_out=rng.randrange(0, 20)
        )
        for _ in range(n)
    ]
    tokens = Sampler()(logits, inputs)
    for i, inp in enumerate(inputs):
        want = reference_distribution(logits[i], inp)
        u = seeded_uniform(inp.params.seed, len(inp.output_token_ids))
        assert tokens[i].token_id == reference_draw(want, u), f"row {i}: {inp.params}"


def test_greedy_fast_path_is_argmax_with_lowest_id_on_ties():
    logits = torch.zeros(3, VOCAB)
    logits[0, [4, 9, 30]] = 2.0
    logits[1, 63] = 1.0
    logits[2] = -1.0
    logits[2, [0, 1]] = -0.5
    inputs = [SamplingInputs(SamplingParams(temperature=0.0), [1], [], EOS) for _ in range(3)]
    assert Sampler.argmax_is_enough(inputs)
    assert [t.token_id for t in Sampler()(logits, inputs)] == [4, 63, 0]
    # The general path agrees with the fast path.
    with_logprobs = [
        SamplingInputs(SamplingParams(temperature=0.0, logprobs=0), [1], [], EOS) for _ in range(3)
    ]
    assert not Sampler.argmax_is_enough(with_logprobs)
    assert [t.token_id for t in Sampler()(logits, with_logprobs)] == [4, 63, 0]


def test_sampler_leaves_the_callers_logits_alone():
    logits = random_logits(4, seed=11)
    before = logits.clone()
    rng = random.Random(0)
    inputs = [make_inputs(SamplingParams(**FIELD_CASES["all"]), rng) for _ in range(4)]
    Sampler()(logits, inputs)
    assert torch.equal(logits, before)


# -- seeding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        dict(temperature=0.8),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=0.8, top_p=0.9, top_k=20),
        dict(temperature=1.2, min_p=0.05, top_p=0.8),
        dict(temperature=0.7, top_k=5, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=2),
    ],
)
@pytest.mark.parametrize("vocab", [VOCAB, 1000])  # 1000: top_p looks at 256 candidates first
def test_seeded_row_same_tokens_alone_and_in_any_batch(target, vocab):
    rng = random.Random(42)
    target_params = SamplingParams(seed=1234, **target)
    target_logits = random_logits(1, seed=99, vocab=vocab)[0] * (0.2 if vocab == VOCAB else 0.5)
    steps = [[rng.randrange(VOCAB) for _ in range(k)] for k in range(8)]  # output so far, per step

    def target_at(step):
        return SamplingInputs(target_params, [1, 2, 3], steps[step], EOS)

    alone = [Sampler(seed=1)(target_logits[None], [target_at(s)])[0].token_id for s in range(8)]
    assert len(set(alone)) > 1  # the draw moves with the step

    others_pool = list(FIELD_CASES.values())
    for trial in range(6):
        sampler = Sampler(seed=trial)  # different engine generators must not matter either
        got = []
        for s in range(8):
            size = rng.randrange(1, 33)
            others = [
                make_inputs(SamplingParams(**rng.choice(others_pool), logprobs=rng.choice([None, 3])), rng)
                for _ in range(size - 1)
            ]
            pos = rng.randrange(size)
            batch = others[:pos] + [target_at(s)] + others[pos:]
            logits = random_logits(size, seed=trial * 100 + s, vocab=vocab)
            logits[pos] = target_logits
            got.append(sampler(logits, batch)[pos].token_id)
        assert got == alone, f"trial {trial}"


def test_seeded_uniform_depends_only_on_seed_and_step():
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    assert seeded_uniform(5, 3) != seeded_uniform(5, 4)
    assert seeded_uniform(5, 3) != seeded_uniform(6, 3)
    assert 0.0 <= seeded_uniform(-1, 0) < 1.0
    values = [seeded_uniform(s, step) for s in range(200) for step in range(20)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    # Evenly spread: each tenth of [0, 1) gets about a tenth of the values.
    counts = Counter(int(v * 10) for v in values)
    assert all(abs(counts[b] / len(values) - 0.1) < 0.015 for b in range(10))


def test_unseeded_rows_follow_the_engine_generator():
    logits = random_logits(16, seed=5)
    inputs = [SamplingInputs(SamplingParams(temperature=1.0), [1], [], EOS) for _ in range(16)]
    a = [t.token_id for t in Sampler(seed=3)(logits, inputs)]
    b = [t.token_id for t in Sampler(seed=3)(logits, inputs)]
    c = [t.token_id for t in Sampler(seed=4)(logits, inputs)]
    assert a == b
    assert a != c


# -- distribution sanity ------------------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_equal_greedy():
    rng = random.Random(1)
    logits = random_logits(32, seed=8)
    greedy = [
        t.token_id
        for t in Sampler()(logits, [make_inputs(SamplingParams(temperature=0.0), rng) for _ in range(32)])
    ]
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        inputs = [make_inputs(SamplingParams(temperature=1.3, **params), rng) for _ in range(32)]
        assert [t.token_id for t in Sampler()(logits, inputs)] == greedy, params


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_frequencies_match_softmax(temperature):
    vocab, draws = 8, 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    logits = row.expand(draws, vocab).contiguous()
    inputs = [SamplingInputs(SamplingParams(temperature=temperature), [0], [], [vocab + 1])] * draws
    tokens = [t.token_id for t in Sampler(seed=0)(logits, inputs)]
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / draws
    want = torch.softmax(row.double() / temperature, dim=0)
    # Four standard errors of a binomial proportion: fails by chance far less than once in 10^4.
    tolerance = 4 * torch.sqrt(want * (1 - want) / draws) + 1e-3
    assert torch.all((freq - want).abs() <= tolerance), (freq, want)


def test_seeded_draws_over_many_seeds_match_softmax():
    vocab, draws = 6, 12000
    row = torch.tensor([0.2, 1.5, -0.7, 0.9, 0.0, 1.1])
    logits = row.expand(draws, vocab).contiguous()
    inputs = [SamplingInputs(SamplingParams(temperature=1.0, seed=s), [0], [], [99]) for s in range(draws)]
    tokens = [t.token_id for t in Sampler()(logits, inputs)]
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / draws
    want = torch.softmax(row.double(), dim=0)
    assert torch.all((freq - want).abs() <= 4 * torch.sqrt(want * (1 - want) / draws) + 1e-3)


def test_top_k_and_top_p_never_draw_outside_the_kept_set():
    vocab, draws = 10, 4000
    row = torch.arange(vocab, dtype=torch.float32) * 0.3  # token 9 most likely
    logits = row.expand(draws, vocab).contiguous()
    k_inputs = [SamplingInputs(SamplingParams(temperature=1.0, top_k=3), [0], [], [99])] * draws
    assert set(t.token_id for t in Sampler(seed=1)(logits, k_inputs)) == {7, 8, 9}
    probs = torch.softmax(row, dim=0)
    p = float(probs[9] + probs[8]) - 1e-4  # tokens 9 and 8 reach p only together
    p_inputs = [SamplingInputs(SamplingParams(temperature=1.0, top_p=p), [0], [], [99])] * draws
    assert set(t.token_id for t in Sampler(seed=1)(logits, p_inputs)) == {8, 9}


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.5, 0.0, 0.0, 0.5, 0.0]])
    top = torch.tensor([1.0 - 2**-53, 1.0 - 2**-53], dtype=torch.float64)
    assert _inverse_cdf(probs.clone(), top).tolist() == [2, 3]
    bottom = torch.zeros(2, dtype=torch.float64)
    assert _inverse_cdf(probs.clone(), bottom).tolist() == [1, 0]
    # u * total rounding up to the total itself still lands on the last token with weight.
    assert _inverse_cdf(probs.clone(), torch.ones(2, dtype=torch.float64)).tolist() == [2, 3]


# -- min_tokens, ignore_eos, logprobs, errors ---------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 5] = 10.0  # EOS
    logits[0, 3] = 9.0  # a stop token id
    logits[0, 20] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    pick = lambda n_out, p=params: Sampler()(logits, [SamplingInputs(p, [1], [0] * n_out, EOS)])[0].token_id  # noqa: E731
    assert [pick(n) for n in range(5)] == [20, 20, 20, 5, 5]
    # ignore_eos: EOS is an ordinary token and is never masked; stop ids still are until min_tokens.
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    assert [pick(n, ignore) for n in range(5)] == [5, 5, 5, 5, 5]
    logits[0, 5] = -5.0
    assert [pick(n, ignore) for n in range(5)] == [20, 20, 20, 3, 3]


def test_min_tokens_ignores_ids_outside_the_vocabulary():
    logits = random_logits(1, seed=2)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[VOCAB + 5])
    assert Sampler()(logits, [SamplingInputs(p, [1], [], [VOCAB + 1])])[0].token_id == int(logits[0].argmax())


def test_logprobs_are_raw_model_logprobs():
    rng = random.Random(3)
    logits = random_logits(5, seed=4)
    raw = torch.log_softmax(logits, dim=1)
    inputs = [
        make_inputs(SamplingParams(temperature=0.0, logprobs=3), rng),
        make_inputs(
            SamplingParams(temperature=0.5, top_k=4, repetition_penalty=1.5, logprobs=5, seed=1), rng
        ),
        make_inputs(SamplingParams(temperature=1.0, logprobs=0, seed=2), rng),
        make_inputs(SamplingParams(temperature=1.0, seed=3), rng),
        make_inputs(
            SamplingParams(
                temperature=0.0, min_tokens=99, logprobs=20, stop_token_ids=[int(logits[4].argmax())]
            ),
            rng,
        ),
    ]
    out = Sampler()(logits, inputs)
    for i, (tok, inp) in enumerate(zip(out, inputs, strict=True)):
        n = inp.params.logprobs
        if n is None:
            assert tok.logprob is None and tok.top_logprobs == []
            continue
        assert tok.logprob == pytest.approx(float(raw[i, tok.token_id]), abs=1e-6)
        assert len(tok.top_logprobs) == n
        want_vals, want_ids = raw[i].topk(n) if n else (torch.tensor([]), torch.tensor([]))
        assert [t for t, _ in tok.top_logprobs] == want_ids.tolist()
        assert [v for _, v in tok.top_logprobs] == pytest.approx(want_vals.tolist(), abs=1e-6)
    # Row 4's masked argmax is still reported with its raw logprob at the top.
    assert out[4].top_logprobs[0][0] == int(logits[4].argmax())
    assert out[4].token_id != int(logits[4].argmax())


def test_bad_input_is_a_clear_error():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(random_logits(2), [make_inputs(SamplingParams(), rng)])
    bad = SamplingInputs(SamplingParams(repetition_penalty=1.2), [VOCAB + 3], [1], EOS)
    with pytest.raises(ValueError, match="prompt token ids"):
        Sampler()(random_logits(1), [bad])


# -- truncation details -------------------------------------------------------------------------


def test_ties_at_the_top_k_and_top_p_boundary_are_kept():
    # Logits on a coarse grid (like bf16 logits), so ties are everywhere.
    g = torch.Generator().manual_seed(12)
    logits = torch.randint(-4, 5, (16, VOCAB), generator=g).float() * 0.5
    rng = random.Random(2)
    inputs = [
        make_inputs(
            SamplingParams(
                temperature=1.0,
                seed=i,
                **rng.choice([dict(top_k=3), dict(top_p=0.3), dict(top_k=7, top_p=0.5)]),
            ),
            rng,
        )
        for i in range(16)
    ]
    dist = Sampler().distribution(logits, inputs)
    for i, inp in enumerate(inputs):
        assert dist[i].tolist() == pytest.approx(reference_distribution(logits[i], inp), abs=2e-6)
        kept = dist[i] > 0
        # Every token tied with a kept token is kept too.
        assert torch.equal(kept, logits[i] >= logits[i][kept].min())
        if inp.params.top_k and inp.params.top_p == 1.0:
            assert int(kept.sum()) >= inp.params.top_k


@pytest.mark.parametrize("candidates", [2, 8, 4096])
def test_top_p_candidate_search_and_full_sort_fallback_agree(monkeypatch, candidates):
    import tokenmill.engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    rng = random.Random(candidates)
    # Peaked rows (the cut falls among the first candidates) and flat rows (it does not).
    logits = torch.cat([random_logits(10, seed=1) * 4, random_logits(10, seed=2) * 0.1])
    inputs = [
        make_inputs(SamplingParams(temperature=1.0, top_p=rng.choice([0.3, 0.7, 0.95]), seed=i), rng)
        for i in range(20)
    ]
    dist = Sampler().distribution(logits, inputs)
    for i, inp in enumerate(inputs):
        assert dist[i].tolist() == pytest.approx(reference_distribution(logits[i], inp), abs=2e-6), i


def test_penalties_follow_a_growing_output_across_steps():
    """The engine hands the same SamplingInputs each step with its output list growing."""
    rng = random.Random(9)
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.9
    )
    inp = SamplingInputs(params, [rng.randrange(VOCAB) for _ in range(10)], [], EOS)
    sampler = Sampler()
    for step in range(12):
        logits = random_logits(1, seed=step) * 0.5
        want = reference_distribution(logits[0], inp)
        tok = sampler(logits, [inp])[0].token_id
        assert want[tok] == 1.0
        inp.output_token_ids.append(tok if step % 3 else 4)  # repeat a token now and then


def test_masked_token_stays_masked_under_penalties_that_would_raise_it():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 3.0  # EOS, also repeated in the output with a negative frequency penalty
    logits[0, 11] = 2.0
    params = SamplingParams(
        temperature=0.0,
        min_tokens=10,
        stop_token_ids=[5, 5, 7],
        frequency_penalty=-2.0,
        repetition_penalty=0.5,
    )
    inp = SamplingInputs(params, [5, 11], [5, 5, 5], EOS)
    assert Sampler()(logits, [inp])[0].token_id == 11
    assert reference_distribution(logits[0], inp)[11] == 1.0
    assert torch.all(logits[0, [5, 11]] == torch.tensor([3.0, 2.0]))  # put back afterwards


@pytest.mark.parametrize("vocab", [511, 512, 1000, 2048, 4099])
def test_greedy_argmax_equals_torch_argmax_including_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (12, vocab), generator=g).float()  # many ties
    x[0] = float("-inf")
    x[1] = 0.0
    x[2, -1] = 10.0  # maximum in the tail
    x[3, [5, vocab - 1]] = 10.0  # tie between the first block and the tail
    x[4, [300, 290]] = 10.0  # tie inside one block
    x[5, [700 % vocab, 260]] = 10.0  # tie across blocks
    assert torch.equal(greedy_argmax(x), x.argmax(dim=1))
    y = torch.randn(7, vocab, generator=g)
    assert torch.equal(greedy_argmax(y), y.argmax(dim=1))


@pytest.mark.parametrize("trial", range(12))
def test_random_mixes_match_reference_alone_and_batched(trial):
    """Random params per row, vocabularies past the top_p candidates, tie-heavy logits."""
    rng = random.Random(trial)
    vocab = rng.choice([64, 300, 700])
    n = rng.randrange(1, 10)
    logits = random_logits(n, seed=trial, vocab=vocab) * rng.choice([0.1, 0.33, 1.0])
    if trial % 3 == 0:
        logits = (logits * 2).round() / 2
    inputs = []
    for _ in range(n):
        kw = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), seed=rng.randrange(1 << 30))
        for name, choices in (
            ("top_k", [1, 2, 5, 50, 400]),
            ("top_p", [0.1, 0.5, 0.9, 0.99]),
            ("min_p", [0.01, 0.1, 0.5]),
            ("repetition_penalty", [0.8, 1.3]),
            ("presence_penalty", [-1.0, 1.0]),
            ("frequency_penalty", [-0.5, 0.7]),
        ):
            if rng.random() < 0.35:
                kw[name] = rng.choice(choices)
        if rng.random() < 0.3:
            kw.update(min_tokens=5, stop_token_ids=[rng.randrange(vocab)], ignore_eos=rng.random() < 0.5)
        inputs.append(
            SamplingInputs(
                SamplingParams(**kw),
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))],
                [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))],
                [rng.randrange(vocab)],
            )
        )
    sampler = Sampler()
    dist = sampler.distribution(logits, inputs)
    tokens = sampler(logits, inputs)
    for i, inp in enumerate(inputs):
        want = reference_distribution(logits[i], inp)
        assert dist[i].tolist() == pytest.approx(want, abs=1e-5), i
        assert [q > 0 for q in dist[i].tolist()] == [q > 0 for q in want], i
        assert tokens[i].token_id == reference_draw(
            want, seeded_uniform(inp.params.seed, len(inp.output_token_ids))
        )
        assert sampler(logits[i : i + 1], [inp])[0].token_id == tokens[i].token_id


def test_the_vectorised_seeded_uniforms_are_seeded_uniforms_bits():
    import random

    from tokenmill.engine.sampler import seeded_uniforms

    rng = random.Random(3)
    edges = [0, 1, -1, 2**63, 2**64 - 1, 2**64, 2**70 + 5, -(2**65)]
    seeds = edges + [rng.randrange(-(2**66), 2**66) for _ in range(2000)]
    steps = [rng.choice(edges) if i % 5 == 0 else rng.randrange(0, 10**6) for i in range(len(seeds))]
    got = seeded_uniforms(seeds, steps)
    assert got.dtype == torch.float64
    assert got.tolist() == [seeded_uniform(a, b) for a, b in zip(seeds, steps, strict=True)]
    assert seeded_uniforms([], []).numel() == 0


def test_penalty_edits_follow_the_outputs_appended_between_steps():
    """The penalties keep each row's output ids as an array and convert only what was appended since
    the last step: the edits equal those of fresh inputs at every step, a new output list is read
    whole, and an appended id outside the vocabulary is refused."""
    from tokenmill.engine.sampler import logit_edits

    params = SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3,
                            presence_penalty=0.1)
    outputs = [[5, 5, 9], [], [1]]
    inputs = [SamplingInputs(params, [3, 5, 7, 3], out, []) for out in outputs]

    def same_as_fresh():
        got = logit_edits(inputs, 40, torch.device("cpu"))
        want = logit_edits([SamplingInputs(params, [3, 5, 7, 3], list(i.output_token_ids), []) for i in inputs],
                           40, torch.device("cpu"))
        for name in ("penalised", "counts", "rep", "freq", "pres"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        return got

    same_as_fresh()
    for step in range(40):  # past the array's first capacity (16)
        for r, out in enumerate(outputs):
            out.append((step * (r + 2)) % 11)
        edits = same_as_fresh()
    assert float(edits.counts.max()) > 3  # repeated output ids counted
    inputs[0].output_token_ids = [1, 2]  # another list: read whole
    same_as_fresh()
    outputs[1].append(40)
    with pytest.raises(ValueError, match="output token ids must be in"):
        logit_edits(inputs, 40, torch.device("cpu"))


def test_a_penalised_row_with_no_position_to_penalise_yet_is_sampled_as_it_is():
    """A frequency or presence penalty before the first output token (and no repetition penalty, so
    the prompt is not penalised): no position is edited, and the row's token is its plain argmax."""
    from tokenmill.engine.sampler import logit_edits

    params = SamplingParams(max_tokens=5, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2)
    inputs = [SamplingInputs(params, [1, 2, 3], [], []), SamplingInputs(params, [4], [], [])]
    edits = logit_edits(inputs, VOCAB, torch.device("cpu"))
    assert edits is not None and edits.penalised.numel() == 0 and edits.counts.numel() == 0
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    assert [t.token_id for t in Sampler(seed=0)(logits.clone(), inputs)] == logits.argmax(dim=1).tolist()
