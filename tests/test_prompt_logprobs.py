"""Prompt logprobs (sampling.prompt_logprobs): the engine's scores equal transformers' (fp32
log_softmax over the same prompt) within 1e-4, rank and is_greedy agree; plain, with chunked
prefill, from the prefix cache (the shared context served from it, still equal), with preemption,
with score_from > 1 and max_tokens 0; bad values are refused."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams
from tokenmill.tools.tiny_models import cached_tiny_model

TOL = 1e-4
TOP_N = 5


def kv_gb(model_dir, num_blocks, block_size=16):
    from tokenmill.engine.model_config import load_model_config

    mc = load_model_config(model_dir, "float32")
    return num_blocks * ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype,
                                                       block_size) / 1024**3


@pytest.fixture(scope="module", params=["test-llama", "test-qwen2"])
def case(request):
    model_dir = cached_tiny_model(request.param)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(7)
    context = [rng.randrange(3, vocab) for _ in range(70)]  # shared by the "choices" below
    prompts = [context + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 33, 50)]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            logits = hf(torch.tensor([p])).logits[0].float()
            refs.append(torch.log_softmax(logits, dim=-1))
    return {"dir": model_dir, "prompts": prompts, "refs": refs, "context_len": len(context)}


def scoring(i, p, score_from=1, max_tokens=1, prefix="r"):
    return EngineRequest(
        request_id=f"{prefix}{i}", prompt_token_ids=p,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=TOP_N, score_from=score_from),
    )


def check(delta, prompt, ref, score_from=1):
    """The delta's scores against transformers' log_softmax rows."""
    records = delta.prompt_logprobs
    assert [r.position for r in records] == list(range(score_from, len(prompt)))
    greedy = True
    for r in records:
        row = ref[r.position - 1]
        want = float(row[prompt[r.position]])
        assert r.token_id == prompt[r.position]
        assert abs(r.logprob - want) < TOL, (r.position, r.logprob, want)
        assert r.rank == int((row > row[prompt[r.position]]).sum()) + 1
        top = torch.topk(row, TOP_N)
        assert [i for i, _ in r.top_logprobs] == top.indices.tolist()
        assert all(abs(lp - w) < TOL for (_, lp), w in zip(r.top_logprobs, top.values.tolist(), strict=True))
        greedy &= int(row.argmax()) == prompt[r.position]
    assert delta.is_greedy == greedy
    assert abs(delta.prompt_logprob_sum - sum(float(ref[p - 1][prompt[p]]) for p in range(score_from, len(prompt)))) \
        < TOL * len(records)


def run(engine, case, **kw):
    res = engine.generate(scoring(i, p, **kw) for i, p in enumerate(case["prompts"]))
    for i, p in enumerate(case["prompts"]):
        check(res[f"r{i}"], p, case["refs"][i], kw.get("score_from", 1))
    return res


def test_prompt_logprobs_equal_transformers_without_cache_or_chunking(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200),
                                 enable_prefix_caching=False))
    res = run(engine, case)
    assert all(d.finish_reason is FinishReason.LENGTH and len(d.output_token_ids) == 1 for d in res.values())


def test_a_greedy_prompt_is_reported_greedy(case):
    """A prompt built from the model's own greedy continuation scores is_greedy, with rank 1 throughout."""
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200)))
    start = case["prompts"][4]
    gen = engine.generate([EngineRequest(request_id="g", prompt_token_ids=start,
                                         sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    prompt = start + gen["g"].output_token_ids
    res = engine.generate([scoring(0, prompt, score_from=len(start), max_tokens=0)])
    assert res["r0"].is_greedy is True and all(r.rank == 1 for r in res["r0"].prompt_logprobs)


def test_prompt_logprobs_with_chunked_prefill(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200),
                                 max_num_batched_tokens=7, enable_prefix_caching=False))
    run(engine, case)


def test_shared_context_comes_from_the_prefix_cache_and_scores_stay_equal(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200)))
    ctx = case["context_len"]
    # The context once, then its four continuations scored from score_from = ctx.
    engine.generate([EngineRequest(request_id="warm", prompt_token_ids=case["prompts"][0][:ctx],
                                   sampling=SamplingParams(max_tokens=1))])
    computed_before = engine.metrics.prompt_tokens_computed
    res = engine.generate(scoring(i, case["prompts"][i], score_from=ctx, max_tokens=0) for i in range(4))
    for i in range(4):
        d = res[f"r{i}"]
        check(d, case["prompts"][i], case["refs"][i], ctx)
        assert d.usage.cached_prompt_tokens == (ctx - 1) // 16 * 16 > 0
        assert d.finish_reason is FinishReason.LENGTH and d.output_token_ids == []
    computed = engine.metrics.prompt_tokens_computed - computed_before
    assert computed == sum(len(case["prompts"][i]) for i in range(4)) - 4 * ((ctx - 1) // 16 * 16)
    # Another tenant's request shares no cache with the context: computed whole, same scores.
    other = scoring(8, case["prompts"][1], score_from=ctx, max_tokens=0)
    other.tenant = "other"
    salted = engine.generate([other])["r8"]
    assert salted.usage.cached_prompt_tokens == 0
    check(salted, case["prompts"][1], case["refs"][1], ctx)
    # score_from = 1 with the cache on: nothing of the prompt can come from it.
    again = engine.generate([scoring(9, case["prompts"][0])])
    assert again["r9"].usage.cached_prompt_tokens == 0
    check(again["r9"], case["prompts"][0], case["refs"][0])


def test_prompt_logprobs_under_preemption(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 8),
                                 max_num_batched_tokens=32))
    res = engine.generate(scoring(i, p, max_tokens=40) for i, p in enumerate(case["prompts"]))
    assert engine.metrics.num_preemptions > 0
    for i, p in enumerate(case["prompts"]):
        check(res[f"r{i}"], p, case["refs"][i])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_a_preemption_in_the_middle_of_scoring_scores_each_position_once(case, caching):
    """Chunked prefill, every running request preempted while its prompt is half scored: the
    recompute keeps the records it has (and, with the cache, reads it up to the next position to
    score), so each position has one record and all still equal transformers'."""
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200),
                                 max_num_batched_tokens=40, enable_prefix_caching=caching))
    prompts = case["prompts"][:4]
    for i, p in enumerate(prompts):
        engine.add(scoring(i, p, score_from=5, max_tokens=2))
    results, partial = {}, 0
    while engine.has_work():
        for d in engine.step():
            if d.finished:
                results[d.request_id] = d
        if not partial:
            partial = sum(1 for r in engine.scheduler.running if 5 < r.next_score_pos < r.num_prompt_tokens)
            if partial:
                engine.scheduler.preempt_all()
    assert partial > 0 and engine.metrics.num_preemptions > 0
    for i, p in enumerate(prompts):
        check(results[f"r{i}"], p, case["refs"][i], 5)


def test_scoring_requests_join_an_overlapped_engine(case):
    """Async scheduling: scoring requests arrive while overlapped decode steps are in flight; the
    steps turn synchronous while they run, scores equal transformers' and the plain requests'
    output equals a synchronous engine's."""
    def plain():
        return [EngineRequest(request_id=f"p{i}", prompt_token_ids=p[:20],
                              sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(case["prompts"][4:])]

    def engine(mode):
        return Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200),
                                   async_scheduling=mode))

    want = {k: d.output_token_ids for k, d in engine("off").generate(plain()).items()}
    eng = engine("on")
    assert eng.async_scheduling
    for r in plain():
        eng.add(r)
    results = {}
    for _ in range(3):
        results.update({d.request_id: d for d in eng.step() if d.finished})
    assert eng.overlap.in_flight is not None
    for i, p in enumerate(case["prompts"][:4]):
        eng.add(scoring(i, p, score_from=3))
    while eng.has_work():
        results.update({d.request_id: d for d in eng.step() if d.finished})
    assert {k: results[k].output_token_ids for k in want} == want
    for i, p in enumerate(case["prompts"][:4]):
        check(results[f"r{i}"], p, case["refs"][i], 3)


def test_score_from_and_max_tokens_zero(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb(case["dir"], 200)))
    res = run(engine, case, score_from=2, max_tokens=0)
    assert all(d.output_token_ids == [] and d.usage.completion_tokens == 0 for d in res.values())
    assert engine.stats().generated_tokens_total == 0


def test_logits_are_computed_for_the_scored_positions_only_and_in_bounded_chunks(monkeypatch):
    # The greedy sampling row would take the greedy screen (no logits at all): count logits rows only.
    model_dir = cached_tiny_model("test-llama")
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=kv_gb(model_dir, 200),
                                 enable_prefix_caching=False, greedy_screen="off"))
    model = engine.runner.model
    rows: list[int] = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h, out=None: rows.append(h.shape[0]) or real(h, out=out))
    rng = random.Random(3)
    prompt = [rng.randrange(3, 2048) for _ in range(700)]
    res = engine.generate([scoring(0, prompt, max_tokens=0)])
    assert len(res["r0"].prompt_logprobs) == 699
    assert rows == [256, 256, 187]  # the 699 scored rows, 256 at a time; no sampling row
    rows.clear()
    res = engine.generate([scoring(1, prompt, score_from=690, max_tokens=1)])
    assert [r.position for r in res["r1"].prompt_logprobs] == list(range(690, 700))
    assert rows == [10, 1]  # the scored positions, then the one sampling row


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="score_from"):
        SamplingParams(prompt_logprobs=0, score_from=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=65)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_the_engine_refuses_what_it_cannot_run():
    engine = Engine(EngineConfig(model=str(cached_tiny_model("test-llama")), dtype="float32", kv_cache_gb=0.01))
    with pytest.raises(ValueError, match=r"n > 1 needs max_tokens >= 1"):
        engine.add(EngineRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                                 sampling=SamplingParams(n=2, max_tokens=0, prompt_logprobs=0)))
    with pytest.raises(ValueError, match="score_from"):
        engine.add(EngineRequest(request_id="b", prompt_token_ids=[5, 6, 7],
                                 sampling=SamplingParams(prompt_logprobs=1, score_from=3)))
    assert not engine.has_work()


def test_the_prefix_cache_limit_follows_the_next_position_to_score():
    from tokenmill.engine.request import Request
    from tokenmill.engine.types import PromptLogprob

    def req(**sampling):
        return Request(EngineRequest(request_id="x", prompt_token_ids=list(range(3, 43)),
                                     sampling=SamplingParams(**sampling)), list(range(3, 43)))

    assert req().prefix_cache_limit == 39  # a plain request: all but the last token
    scored = req(prompt_logprobs=0, score_from=20)
    assert scored.prefix_cache_limit == 19  # the hidden state of position 19 scores position 20
    scored.add_prompt_scores([PromptLogprob(position=p, token_id=p + 3, logprob=-1.0, rank=2) for p in range(20, 31)])
    assert scored.next_score_pos == 31 and scored.prefix_cache_limit == 30  # kept across a preemption
    with pytest.raises(RuntimeError, match="expected 31"):
        scored.add_prompt_scores([PromptLogprob(position=30, token_id=33, logprob=-1.0, rank=1)])
    scored.add_prompt_scores([PromptLogprob(position=p, token_id=p + 3, logprob=-1.0, rank=1) for p in range(31, 40)])
    assert scored.prefix_cache_limit == 39  # all scored: the cache may serve what it serves any request
