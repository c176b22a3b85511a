"""`n` samples of one prompt (sampling.n > 1): the prompt is computed once and its KV blocks shared
(prefill tokens computed equal one prompt's), choice i with seed + i equals a single request with
that seed, token for token, across runs, with async scheduling, under preemption and when the
fork has no room; a group ends as one delta with every choice; aborts, refusals and errors end all
choices; nothing is left held."""

from __future__ import annotations

import random

import pytest

from tests.test_prompt_logprobs import kv_gb
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import EngineRequest, ErrorKind, FinishReason, SamplingParams
from tokenmill.tools.tiny_models import cached_tiny_model


@pytest.fixture(scope="module")
def model_dir():
    return cached_tiny_model("test-llama")


def make_engine(model_dir, num_blocks=400, **kw):
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=kv_gb(model_dir, num_blocks), **kw))


def prompts(count, length=37, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length + i)] for i in range(count)]


def sampled(seed, n=1, max_tokens=12, **kw):
    # top_k keeps seeded draws away from float-precision ties (docs/engine.md, "n samples").
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=seed, ignore_eos=True, n=n, **kw)


def group_choices(engine, ps, n, seed0=100, **kw):
    reqs = [EngineRequest(request_id=f"g{i}", prompt_token_ids=p, sampling=sampled(seed0 + 10 * i, n=n, **kw))
            for i, p in enumerate(ps)]
    res = engine.generate(reqs)
    assert set(res) == {f"g{i}" for i in range(len(ps))}
    return {rid: [c.token_ids for c in d.choices] for rid, d in res.items()}, res


def single_choices(engine, ps, n, seed0=100, **kw):
    reqs = [EngineRequest(request_id=f"s{i}-{j}", prompt_token_ids=p, sampling=sampled(seed0 + 10 * i + j, **kw))
            for i, p in enumerate(ps) for j in range(n)]
    res = engine.generate(reqs)
    return {f"g{i}": [res[f"s{i}-{j}"].output_token_ids for j in range(n)] for i in range(len(ps))}


def assert_idle(engine):
    while engine.has_work():  # an overlapped step may still be in flight after the last result
        engine.step()
    held = engine.held_state()
    assert not any(held.values()), {k: v for k, v in held.items() if v}
    engine.block_manager.check_invariants()


def test_n_samples_compute_the_prompt_once_and_equal_single_seeded_requests(model_dir):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    p = prompts(1, length=53)
    before = engine.metrics.prompt_tokens_computed
    got, res = group_choices(engine, p, n=8)
    assert engine.metrics.prompt_tokens_computed - before == 53  # one prompt's, not 8
    assert_idle(engine)
    want = single_choices(engine, p, n=8)
    assert got == want
    d = res["g0"]
    assert [c.index for c in d.choices] == list(range(8))
    assert len({tuple(t) for t in got["g0"]}) > 1  # the seeds differ, so do the samples
    assert d.output_token_ids == d.choices[0].token_ids and d.output_text == d.choices[0].text
    assert d.usage.prompt_tokens == 53 and d.usage.completion_tokens == 8 * 12
    assert all(c.finish_reason is FinishReason.LENGTH and c.completion_tokens == 12 for c in d.choices)
    # Identical across runs (a fresh engine).
    again, _ = group_choices(make_engine(model_dir), p, n=8)
    assert again == got


def test_forked_choices_reference_the_prompt_blocks(model_dir):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    p = prompts(1, length=50)[0]  # 3 full blocks of 16 and 2 tokens in a fourth
    engine.add(EngineRequest(request_id="f", prompt_token_ids=p, sampling=sampled(9, n=5)))
    engine.step()
    group = engine.groups["f"]
    assert not group.unforked
    tables = [m.kv.block_table for m in group.members]
    refs = engine.block_manager.ref_counts
    assert all(t[:3] == tables[0][:3] for t in tables) and all(refs[b] == 5 for b in tables[0][:3])
    assert len({t[3] for t in tables}) == 5  # each choice writes its own copy of the last block
    assert engine.block_manager.num_used_blocks == 3 + 5
    while engine.has_work():
        engine.step()
    assert_idle(engine)


def test_token_deltas_name_their_choice_and_rebuild_each_choice(model_dir):
    engine = make_engine(model_dir)
    engine.add(EngineRequest(request_id="j", prompt_token_ids=prompts(1)[0], sampling=sampled(5, n=3)))
    texts, ids, final = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}, None
    while engine.has_work():
        for d in engine.step():
            assert d.request_id == "j" and d.choice in (0, 1, 2)
            texts[d.choice] += d.text_delta
            ids[d.choice] += d.new_token_ids
            if d.finished:
                assert final is None
                final = d
    assert final is not None
    for c in final.choices:
        assert ids[c.index] == c.token_ids and texts[c.index] == c.text
    assert_idle(engine)


@pytest.mark.parametrize("setting", ["async", "preemption", "no-room-to-fork", "prefix-cache", "chunked"])
def test_choices_equal_single_requests_in_every_engine_mode(model_dir, setting):
    kw = {
        "async": dict(async_scheduling="on"),
        "preemption": dict(num_blocks=14),
        "no-room-to-fork": dict(max_num_seqs=3),
        "prefix-cache": dict(),
        "chunked": dict(max_num_batched_tokens=32),
    }[setting]
    engine = make_engine(model_dir, **kw)
    ps = prompts(3, length=40)
    got, _ = group_choices(engine, ps, n=4)
    assert_idle(engine)
    computed, one_each = engine.metrics.prompt_tokens_computed, sum(map(len, ps))
    if setting == "no-room-to-fork":
        assert computed > one_each  # children that could not fork computed their own last blocks
    elif setting != "preemption":
        assert computed == one_each
    if setting == "preemption":
        assert engine.metrics.num_preemptions > 0
    if setting == "async":
        assert engine.async_scheduling
    want = single_choices(make_engine(model_dir), ps, n=4)
    assert got == want


def test_n_with_logprobs_and_prompt_logprobs(model_dir):
    engine = make_engine(model_dir)
    p = prompts(1)[0]
    d = engine.generate([EngineRequest(request_id="x", prompt_token_ids=p,
                                       sampling=sampled(1, n=3, logprobs=2, prompt_logprobs=1))])["x"]
    assert len(d.prompt_logprobs) == len(p) - 1 and d.is_greedy is not None
    for c in d.choices:
        assert [r.token_id for r in c.logprobs] == c.token_ids
    single = engine.generate([EngineRequest(request_id="y", prompt_token_ids=p,
                                            sampling=sampled(1, logprobs=2, prompt_logprobs=1))])["y"]
    assert abs(single.prompt_logprob_sum - d.prompt_logprob_sum) < 1e-4
    assert single.output_token_ids == d.choices[0].token_ids
    assert_idle(engine)


def test_abort_ends_every_choice_and_frees_everything(model_dir):
    engine = make_engine(model_dir)
    engine.add(EngineRequest(request_id="a", prompt_token_ids=prompts(1)[0], sampling=sampled(2, n=4, max_tokens=200)))
    for _ in range(3):
        engine.step()
    engine.abort("a")
    finals = []
    while engine.has_work():
        finals += [d for d in engine.step() if d.finished]
    assert len(finals) == 1 and finals[0].finish_reason is FinishReason.ABORTED
    assert_idle(engine)


def test_an_over_long_prompt_fails_every_choice(model_dir):
    engine = make_engine(model_dir, max_model_len=64)
    d = engine.generate([EngineRequest(request_id="L", prompt_token_ids=prompts(1, length=80)[0],
                                       sampling=sampled(2, n=3))])["L"]
    assert d.finish_reason is FinishReason.ERROR and d.error_kind is ErrorKind.PROMPT_TOO_LONG
    assert_idle(engine)


def test_unsupported_combinations_are_refused(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        engine.add(EngineRequest(request_id="s", prompt_token_ids=prompts(1)[0],
                                 sampling=SamplingParams(max_tokens=0, prompt_logprobs=0, n=2)))
    assert_idle(engine)


def test_constrained_choices_each_follow_the_constraint_and_equal_single_requests(model_dir):
    """Each forked choice gets its own matcher and its parent row's mask for the first token."""
    import json

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y", "z"]}},
              "required": ["a", "b"], "additionalProperties": False}
    kw = dict(max_tokens=40, structured_outputs={"json": schema})
    engine = make_engine(model_dir)
    ps = prompts(2)
    got, res = group_choices(engine, ps, n=4, **kw)
    for d in res.values():
        for c in d.choices:
            assert c.finish_reason is FinishReason.STOP, c.text
            value = json.loads(c.text)
            assert set(value) == {"a", "b"} and value["b"] in "xyz"
    assert_idle(engine)
    assert got == single_choices(make_engine(model_dir), ps, n=4, **kw)


def test_abort_after_some_choices_ended_keeps_their_ends(model_dir):
    engine = make_engine(model_dir)
    p = prompts(1)[0]
    first = engine.generate([EngineRequest(request_id="probe", prompt_token_ids=p, sampling=sampled(11))])["probe"]
    stop = first.output_token_ids[2]  # choice 0 (seed 11) stops on its third token
    others = {t for j in (1, 2) for t in engine.generate([EngineRequest(
        request_id=f"o{j}", prompt_token_ids=p, sampling=sampled(11 + j, max_tokens=8))])[f"o{j}"].output_token_ids}
    assert stop not in others  # so choices 1 and 2 run on (a different prompt would fix this)
    engine.add(EngineRequest(request_id="a", prompt_token_ids=p,
                             sampling=sampled(11, n=3, max_tokens=200, stop_token_ids=[stop])))
    deltas = []
    while not any(d.choice == 0 and d.request_id == "a" and not d.finished and d.new_token_ids == [stop]
                  for d in deltas):
        deltas += engine.step()
    engine.abort("a")
    while engine.has_work():
        deltas += engine.step()
    (final,) = [d for d in deltas if d.finished]
    assert final.finish_reason is FinishReason.ABORTED
    assert [c.finish_reason for c in final.choices] == [FinishReason.STOP, FinishReason.ABORTED, FinishReason.ABORTED]
    assert final.choices[0].token_ids == first.output_token_ids[:3]
    assert_idle(engine)


def test_choices_keep_their_tenant_salt(model_dir):
    """The forked choices hash their blocks with the tenant's salt: a later request of the same
    prompt hits the cache in that tenant only."""
    engine = make_engine(model_dir)
    p = prompts(1, length=70)[0]
    engine.generate([EngineRequest(request_id="t", prompt_token_ids=p, sampling=sampled(3, n=4), tenant="acme")])
    assert_idle(engine)
    again = {
        tenant: engine.generate([EngineRequest(request_id=f"r-{tenant}", prompt_token_ids=p, sampling=sampled(3),
                                               tenant=tenant)])[f"r-{tenant}"].usage.cached_prompt_tokens
        for tenant in ("acme", "other")
    }
    assert again == {"acme": 64, "other": 0}
