"""The greedy screen: a bfloat16 LM head picks candidates, float32 decides, and the token is always the
full float32 head's argmax (near ties and exact ties included); the engine's greedy outputs are
unchanged with it, and rows that need logits still get them."""

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.engine.model_runner import GreedyIds, ModelRunner, SomeIds
from tokenmill.engine.sampler import Sampler, SamplingInputs, greedy_argmax, logit_edits
from tokenmill.engine.types import EngineRequest, SamplingParams
from tokenmill.kernels.cpu import gemm, greedy_screen

pytestmark = pytest.mark.skipif(
    not greedy_screen.bf16_gemm_supported(), reason="this CPU has no bfloat16 GEMM in oneDNN (the screen is off)"
)


def _head(vocab, hidden, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g) * scale


def _full_argmax(hidden, weight, packed):
    return greedy_argmax(gemm.linear(hidden, weight, None, packed))


@pytest.mark.parametrize("hidden_size", [64, 256, 576])
def test_the_token_is_the_full_heads_argmax_at_every_row_count(hidden_size):
    weight = _head(4096, hidden_size)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    assert screen is not None
    x = torch.randn(300, hidden_size, generator=torch.Generator().manual_seed(1))
    want = _full_argmax(x, weight, packed)
    for rows in (1, 3, 64, 257, 300):
        got = screen.greedy_ids(x[:rows])
        assert got is not None and torch.equal(got, want[:rows]), rows
    # a few candidates per row are computed in float32, not the whole vocabulary
    assert 300 <= screen.last_candidates < 300 * 64


def test_the_screen_meets_every_row_count_at_load_not_in_the_first_batch(monkeypatch):
    """Building the screen runs its bfloat16 GEMM once at each row count a step can give it, so
    oneDNN's first-use work for each count is done at load; a later call at any count is one of them."""
    seen = []
    real = gemm.linear
    monkeypatch.setattr(gemm, "linear", lambda x, *a: seen.append((x.shape[0], x.dtype)) or real(x, *a))
    weight = _head(1024, 64)
    packed = gemm.pack(weight)
    seen.clear()
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    assert screen is not None
    counts = gemm.row_counts()
    assert {rows for rows, dtype in seen if dtype == torch.bfloat16} == set(counts)
    assert len(counts) == 32 and counts[0] == gemm.MAX_ROWS
    assert {gemm._padded_rows(rows) for rows in range(1, gemm.MAX_ROWS + 1)} == set(counts)


def test_candidate_logits_are_the_full_heads_bits():
    weight = _head(2048, 576, seed=3)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4))
    full = gemm.linear(x, weight, None, packed)
    rows = torch.arange(4).repeat_interleave(2048)
    cols = torch.arange(2048).repeat(4)
    got = torch.empty(rows.numel())
    screen._lib.logits_at(x.data_ptr(), x.stride(0), weight.data_ptr(), 576, screen.k_block, rows.data_ptr(),
                          cols.data_ptr(), rows.numel(), got.data_ptr())
    assert torch.equal(got, full.flatten())


def test_near_ties_and_exact_ties_resolve_as_the_full_head():
    """Columns one float32 rounding apart, which bfloat16 cannot tell apart, and duplicated columns
    (an exact tie: the lowest id wins, as torch.argmax)."""
    hidden_size, vocab = 256, 1024
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, hidden_size, generator=g)
    weight = _head(vocab, hidden_size, seed=6)
    # Row r's best direction is x[r]; columns 2r and 2r+1 hold it with one element nudged by an ulp.
    for r in range(64):
        base = x[r] / x[r].norm() * 0.5
        weight[2 * r] = base
        nudged = base.clone()
        nudged[r % hidden_size] = torch.nextafter(nudged[r % hidden_size], torch.tensor(1.0))
        weight[2 * r + 1] = nudged if r % 2 else base  # odd rows: a near tie; even rows: an exact tie
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    want = _full_argmax(x, weight, packed)
    got = screen.greedy_ids(x)
    assert torch.equal(got, want)
    assert all(int(got[r]) in (2 * r, 2 * r + 1) for r in range(64))
    assert all(int(got[r]) == 2 * r for r in range(0, 64, 2))  # exact ties: the lower id


@pytest.mark.parametrize("spread", [False, True])
def test_the_bound_holds_on_the_screen(spread):
    """|screen - float32 logit| stays inside each column's eps_j; with rows of very different norms
    (a trained head's) too."""
    weight = _head(8192, 576, seed=7, scale=0.05)
    if spread:
        weight *= torch.linspace(0.2, 4.0, 8192).unsqueeze(1)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(8)) * 3
    approx = gemm.linear(x.to(torch.bfloat16), weight, None, screen.packed)
    exact = gemm.linear(x, weight, None, packed)
    eps = screen.bound(x, approx)
    err = (approx.double() - exact.double()).abs()
    assert bool((err <= eps).all())
    assert float((err / eps).max()) > 0.1  # the bound is not vacuous by orders of magnitude
    assert torch.equal(screen.greedy_ids(x), _full_argmax(x, weight, packed))


def test_rows_that_are_not_finite_go_to_the_full_head():
    weight = _head(512, 64)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    for bad in (float("inf"), float("nan"), 1e38):  # 1e38: a logit could overflow float32
        x = torch.randn(3, 64)
        x[1, 5] = bad
        assert screen.greedy_ids(x) is None
    x[1, 5] = 1e30  # large, but no sum can overflow: screened as any other row
    assert torch.equal(screen.greedy_ids(x), _full_argmax(x, weight, packed))


def test_a_screen_that_cannot_narrow_sends_rows_to_the_full_head_and_then_turns_itself_off():
    weight = _head(512, 64)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    assert screen.greedy_ids(x) is not None
    # A zero hidden state: every logit is 0, all 512 are candidates (more than MAX_CANDIDATES).
    loose = torch.cat([x[:2], torch.zeros(1, 64)])
    for _ in range(greedy_screen._JUDGE_AFTER - 2):
        assert screen.greedy_ids(loose) is None
    assert screen.enabled  # 15 calls so far: not judged yet
    assert screen.greedy_ids(loose) is None
    assert not screen.enabled and screen.greedy_ids(x) is None  # 15 of 16 fell back: off for good


def test_without_onednn_or_a_finite_float32_head_there_is_no_screen():
    weight = _head(512, 64)
    packed = gemm.pack(weight)
    assert greedy_screen.GreedyScreen.build(weight, None) is None
    assert greedy_screen.GreedyScreen.build(weight.to(torch.bfloat16), packed) is None
    weight_bad = weight.clone()
    weight_bad[3, 3] = float("nan")
    assert greedy_screen.GreedyScreen.build(weight_bad, packed) is None


def test_a_loaded_model_builds_the_screen_at_load_and_rebuilds_it_for_a_new_weight(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend())
    cached = getattr(model, "_lm_head_screen", None)
    assert cached is not None and cached[1] is not None
    hidden = torch.randn(9, model.config.hidden_size)
    assert torch.equal(model.greedy_ids(hidden), greedy_argmax(model.compute_logits(hidden)))
    with torch.no_grad():
        model.lm_head.mul_(-1)
    assert torch.equal(model.greedy_ids(hidden), greedy_argmax(model.compute_logits(hidden)))


def _requests():
    prompts = [[(7 * i + 3 * j) % 1500 + 10 for j in range(5 + 3 * i)] for i in range(12)]
    reqs = [EngineRequest(request_id=f"g{i}", prompt_token_ids=p,
                          sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    return reqs


def _generate(model_dir, requests, monkeypatch, screen_on):
    calls = []
    real = ModelRunner.execute

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(type(out[0]).__name__)  # whole steps and steps in parts alike
        return out

    monkeypatch.setattr(ModelRunner, "execute", spy)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.01, max_model_len=256,
                                 greedy_screen="on" if screen_on else "off"))
    assert (getattr(engine.runner.model, "_lm_head_screen", (None, None))[1] is not None) == screen_on
    results = engine.generate(requests)
    return {rid: list(r.output_token_ids) for rid, r in results.items()}, calls, results


def test_engine_greedy_outputs_are_the_same_with_and_without_the_screen(tiny_llama_dir, monkeypatch):
    on, calls_on, _ = _generate(tiny_llama_dir, _requests(), monkeypatch, True)
    off, calls_off, _ = _generate(tiny_llama_dir, _requests(), monkeypatch, False)
    assert on == off
    assert GreedyIds.__name__ in calls_on and GreedyIds.__name__ not in calls_off


def test_rows_that_need_logits_keep_the_full_head_and_the_greedy_rows_beside_them_take_the_screen(
        tiny_llama_dir, monkeypatch):
    """A batch with a sampled row or a logprobs row is not argmax-only: those rows get the full
    head's logits, the greedy rows beside them (penalised ones too) still take the screen (SomeIds),
    and every row gets the tokens and logprobs it gets without the screen."""
    base = _requests()
    base[1].sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.4)
    mixed = base[:6] + [
        EngineRequest(request_id="lp", prompt_token_ids=[11, 12, 13],
                      sampling=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)),
        EngineRequest(request_id="hot", prompt_token_ids=[21, 22, 23],
                      sampling=SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)),
    ]
    on, calls_on, results = _generate(tiny_llama_dir, mixed, monkeypatch, True)
    off, _, results_off = _generate(tiny_llama_dir, mixed, monkeypatch, False)
    assert on == off
    assert results["lp"].logprobs  # the logprobs row got its logprobs
    assert [lp.logprob for lp in results["lp"].logprobs] == [lp.logprob for lp in results_off["lp"].logprobs]
    # the logprobs and sampled rows outlive the greedy ones: no step was greedy rows alone
    assert GreedyIds.__name__ not in calls_on
    assert SomeIds.__name__ in calls_on


def test_a_sampled_row_beside_greedy_ones_overlapped(tiny_llama_dir, monkeypatch):
    """With async scheduling (sampled and greedy rows, no logprobs: steps overlap) the split step's
    ids go to the next step as one tensor in row order: the same outputs as without the screen, and
    no step failed on the way (fault isolation would rerun such rows alone and hide it)."""
    from tokenmill.engine import overlap

    base = _requests()[:5] + [
        EngineRequest(request_id=f"hot{i}", prompt_token_ids=[21 + i, 22, 23],
                      sampling=SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True))
        for i in range(3)]
    seen = []
    real = overlap._sample_some

    def spy(sampler, some, launched, overlapped):
        try:
            real(sampler, some, launched, overlapped)
        except Exception as e:
            seen.append(repr(e))
            raise
        seen.append(overlapped)

    monkeypatch.setattr(overlap, "_sample_some", spy)
    outputs = {}
    for screen_on in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.01, max_model_len=256,
                                     greedy_screen="on" if screen_on else "off", async_scheduling="on"))
        results = engine.generate(base)
        outputs[screen_on] = {rid: list(r.output_token_ids) for rid, r in results.items()}
    assert outputs[True] == outputs[False]
    assert True in seen and set(seen) == {True}  # overlapped split steps, none of them failing


def test_constrained_greedy_rows_take_the_screen_under_their_mask(tiny_llama_dir, monkeypatch):
    """Rows under a JSON schema are screened with their mask on the screen: the same outputs as the
    full head and the mask (screen off), valid JSON, and their steps return GreedyIds."""
    from tokenmill.engine.types import StructuredOutputsParams
    from tokenmill.tools.structured_workload import SCHEMAS, check_json

    requests = [EngineRequest(request_id=f"s{i}", prompt_token_ids=[(5 * i + j) % 900 + 10 for j in range(6 + i)],
                              sampling=SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=(
                                  StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema))))
                for i in range(8)]
    on, calls_on, results = _generate(tiny_llama_dir, requests, monkeypatch, True)
    off, calls_off, _ = _generate(tiny_llama_dir, requests, monkeypatch, False)
    assert on == off
    assert GreedyIds.__name__ in calls_on and GreedyIds.__name__ not in calls_off
    for i in range(8):
        assert check_json(results[f"s{i}"].output_text, SCHEMAS[i % len(SCHEMAS)].schema) is None


def test_a_step_with_a_mask_and_rows_that_need_logits_screens_its_greedy_rows(tiny_llama_dir, monkeypatch):
    """Constrained rows, greedy and sampled, beside plain greedy ones and a logprobs row: the greedy
    rows (constrained or not) take the screen under their rows of the mask, the others the full head
    with theirs (SomeIds), and every row gets what it gets without the screen, valid JSON included."""
    from tokenmill.engine.types import StructuredOutputsParams
    from tokenmill.tools.structured_workload import SCHEMAS, check_json

    def constrained(i, **extra):
        return EngineRequest(request_id=f"s{i}", prompt_token_ids=[(5 * i + j) % 900 + 10 for j in range(6 + i)],
                             sampling=SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(
                                 json=SCHEMAS[i % len(SCHEMAS)].schema), **extra))

    requests = [*_requests()[:4], constrained(0, temperature=0.0), constrained(1, temperature=0.0),
                constrained(2, temperature=0.8, seed=3), constrained(3, temperature=0.0, logprobs=2),
                EngineRequest(request_id="lp", prompt_token_ids=[11, 12, 13],
                              sampling=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2))]
    masked = []
    real = ModelRunner.execute

    def spy(self, out, *args, **kwargs):
        result = real(self, out, *args, **kwargs)
        token_mask = kwargs.get("token_mask", args[2] if len(args) > 2 else None)
        if token_mask is not None:
            masked.append(type(result[0]).__name__)
        return result

    monkeypatch.setattr(ModelRunner, "execute", spy)
    on, _, results = _generate(tiny_llama_dir, requests, monkeypatch, True)
    on_masked, masked[:] = list(masked), []
    off, _, results_off = _generate(tiny_llama_dir, requests, monkeypatch, False)
    assert on == off
    assert SomeIds.__name__ in on_masked  # steps under a mask split their rows
    assert SomeIds.__name__ not in masked  # (without the screen: the full head for every row)
    for rid in ("s3", "lp"):
        assert [lp.logprob for lp in results[rid].logprobs] == [lp.logprob for lp in results_off[rid].logprobs]
    for i in range(4):
        assert check_json(results[f"s{i}"].output_text, SCHEMAS[i % len(SCHEMAS)].schema) is None


def test_greedy_choices_take_the_screen_once_forked(tiny_llama_dir, monkeypatch):
    """n > 1 needs logits only in the step that forks the choices; afterwards its rows are plain
    greedy rows like any other: GreedyIds, the same outputs as without the screen."""
    requests = [EngineRequest(request_id=f"n{i}", prompt_token_ids=[(3 * i + j) % 700 + 10 for j in range(8)],
                              sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=3))
                for i in range(4)]
    _, calls_on, on = _generate(tiny_llama_dir, requests, monkeypatch, True)
    _, _, off = _generate(tiny_llama_dir, requests, monkeypatch, False)
    assert {rid: [c.token_ids for c in d.choices] for rid, d in on.items()} == {
        rid: [c.token_ids for c in d.choices] for rid, d in off.items()}
    assert GreedyIds.__name__ in calls_on


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """llguidance's int32 bitmask [K, W] of a bool [K, V] (V a multiple of 32): bit j of word w allows 32 w + j."""
    words = (allowed.view(allowed.shape[0], -1, 32).long() << torch.arange(32)).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _edited_inputs(full: torch.Tensor, kind: str, g: torch.Generator) -> list[SamplingInputs]:
    """One SamplingInputs per row whose penalties (or min_tokens block) touch the row's best logits,
    so that the edits change the argmax in many rows."""
    rows, vocab = full.shape
    top = full.topk(6, dim=1).indices
    inputs = []
    for r in range(rows):
        seen = top[r, : 1 + r % 5].tolist() + torch.randint(0, vocab, (20,), generator=g).tolist()
        params = dict(max_tokens=200, temperature=0.0)
        if kind in ("penalties", "both"):
            params.update(repetition_penalty=1.0 + 0.2 * (r % 4), frequency_penalty=0.3 * (r % 3),
                          presence_penalty=0.5 if r % 2 else 0.0)
        eos = [int(top[r, 0])]
        if kind in ("min_tokens", "both"):
            params.update(min_tokens=100, stop_token_ids=[int(top[r, 1])])
        inputs.append(SamplingInputs(SamplingParams(**params), prompt_token_ids=seen[::2],
                                     output_token_ids=seen[1::2] + seen[1:3], eos_token_ids=eos))
    return inputs


@pytest.mark.parametrize("kind", ["penalties", "min_tokens", "both"])
def test_penalised_and_blocked_rows_get_the_samplers_token_from_the_screen(kind):
    """Greedy rows with penalties or a min_tokens block: the screen holds their edited positions out,
    computes those exactly and edits them as the sampler does; the token is the sampler's on the full
    head's logits, at every row count, with a constraint's mask too."""
    weight = _head(4096, 256, seed=12)
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(64, 256, generator=g)
    full = gemm.linear(x, weight, None, packed)
    inputs = _edited_inputs(full, kind, g)
    sampler = Sampler(seed=0)
    want = torch.tensor([t.token_id for t in sampler(full.clone(), inputs)])
    assert not torch.equal(want, greedy_argmax(full))  # the edits changed some rows' tokens
    for rows in (1, 5, 64):
        got = screen.greedy_ids(x[:rows], None, logit_edits(inputs[:rows], 4096, torch.device("cpu")))
        assert got is not None and torch.equal(got, want[:rows]), rows
    # Under a constraint on every other row that allows every other id (so some penalised ids and
    # not others), given as the bitmask the screen's C kernel reads.
    allowed = torch.ones(64, 4096, dtype=torch.bool)
    allowed[::2, 1::2] = False
    masked = full.masked_fill(~allowed, float("-inf"))
    want_masked = torch.tensor([t.token_id for t in sampler(masked, inputs)])
    bitmask = _bitmask(allowed[::2])
    rows = torch.tensor([r // 2 if r % 2 == 0 else -1 for r in range(64)])
    got = screen.greedy_ids(x, lambda n: (bitmask, rows[:n]), logit_edits(inputs, 4096, torch.device("cpu")))
    assert got is not None and torch.equal(got, want_masked)
    assert not torch.equal(want_masked, want)


def test_a_penalised_logit_equal_to_the_best_untouched_one_resolves_to_the_lower_id():
    """Exact ties between a penalised position and the screen's best: the lower id, as torch.argmax
    over the edited row."""
    weight = _head(1024, 64, seed=14)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(15))
    low, high = 100, 900
    weight[low] = weight[high] = x[0] / x[0].norm() * 2  # row 0's best, twice: the same logit's bits
    packed = gemm.pack(weight)
    screen = greedy_screen.GreedyScreen.build(weight, packed)
    full = gemm.linear(x, weight, None, packed)
    assert full[0, low] == full[0, high] == full[0].max()
    for penalised in (low, high):
        # A frequency penalty below half an ulp of the logit: the edited value is the raw one.
        inputs = [SamplingInputs(SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=1e-30),
                                 [], [penalised], []) for _ in range(2)]
        edits = logit_edits(inputs, 1024, torch.device("cpu"))
        assert edits.penalised.numel() == 2
        want = torch.tensor([t.token_id for t in Sampler(seed=0)(full.clone(), inputs)])
        got = screen.greedy_ids(x, None, edits)
        assert got is not None and torch.equal(got, want)
        assert int(want[0]) == low


def test_engine_penalised_greedy_outputs_are_the_same_with_and_without_the_screen(tiny_llama_dir, monkeypatch):
    """Greedy rows with repetition, frequency and presence penalties and min_tokens take the screen
    (GreedyIds) and give the tokens of the full head and the sampler."""
    requests = [EngineRequest(request_id=f"p{i}", prompt_token_ids=[(7 * i + 3 * j) % 40 + 10 for j in range(9)],
                              sampling=SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                                                      frequency_penalty=0.4 * (i % 3), presence_penalty=0.5,
                                                      min_tokens=3 * (i % 2)))
                for i in range(10)]
    on, calls_on, _ = _generate(tiny_llama_dir, requests, monkeypatch, True)
    off, calls_off, _ = _generate(tiny_llama_dir, requests, monkeypatch, False)
    assert on == off
    assert GreedyIds.__name__ in calls_on and GreedyIds.__name__ not in calls_off


def test_the_columns_norms_are_the_float64_norms_of_the_weight_and_its_bfloat16_parts():
    """The bound's column parts, summed in one C pass at load, are torch's float64 norms of w, of
    bf16(w) and of w - bf16(w), to a few ulps of float64 (a bound rounded up to float32 from them)."""
    weight = _head(3001, 576, seed=9, scale=0.05) * torch.linspace(0.2, 4.0, 3001).unsqueeze(1)
    w64, wb = weight.double(), weight.to(torch.bfloat16).double()
    want = [torch.linalg.vector_norm(t, dim=1) for t in (w64, wb, w64 - wb)]
    got = greedy_screen.column_norms(greedy_screen._library.get(), weight.contiguous())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float64 and g.shape == (3001,)
        torch.testing.assert_close(g, w, rtol=1e-14, atol=0.0)
