"""A CPU step's model body cut into parts run side by side (worker/engine/cpu/step_parts.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from tokenmill.engine.cpu.step_parts import SLACK, StepPartPool, default_parts, plan_parts


def _work(n, seq_lens, weight):
    n, seq_lens = np.asarray(n, dtype=np.float64), np.asarray(seq_lens, dtype=np.float64)
    return n + weight * (n * seq_lens - n * (n - 1) / 2)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_parts_are_contiguous_cover_every_request_and_are_near_even(parts):
    rng = np.random.default_rng(parts)
    for _ in range(200):
        count = int(rng.integers(parts, 300))
        n = np.where(rng.random(count) < 0.8, 1, rng.integers(1, 200, count)).astype(np.int64)
        seq_lens = n + rng.integers(0, 600, count)
        cuts = plan_parts(n, seq_lens, parts, 0.01)
        work = _work(n, seq_lens, 0.01)
        if cuts is None:
            # Only refused when no cut comes within the slack: then a part (one big request) is the cause.
            assert work.max() > (SLACK - 1) * work.sum() / parts or count < parts
            continue
        assert len(cuts) == parts and cuts[0].start == 0 and cuts[-1].stop == count
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(cuts, cuts[1:], strict=False))
        shares = [work[c].sum() for c in cuts]
        assert max(shares) <= SLACK * work.sum() / parts + 1e-9


def test_an_even_decode_step_is_cut_in_the_middle():
    n = np.ones(64, dtype=np.int64)
    assert plan_parts(n, np.full(64, 100), 2, 0.01) == [slice(0, 32), slice(32, 64)]


def test_attention_work_moves_the_cut():
    # The first half's rows have 10x the context: with attention weighted the cut moves left.
    n = np.ones(64, dtype=np.int64)
    seq_lens = np.r_[np.full(32, 1000), np.full(32, 100)]
    assert plan_parts(n, seq_lens, 2, 0.01)[0].stop < 32
    assert plan_parts(n, seq_lens, 2, 0.0) == [slice(0, 32), slice(32, 64)]


def test_sampling_rows_weigh_their_lm_head():
    # The first half decodes (each row samples), the second half holds prefill chunks that do not
    # finish their prompt: with the head weighed, the cut moves left.
    n = np.r_[np.ones(32, dtype=np.int64), np.full(4, 8)]
    seq_lens = n + 50
    samples = np.r_[np.ones(32, dtype=bool), np.zeros(4, dtype=bool)]
    even = plan_parts(n, seq_lens, 2, 0.0, samples, 0.0)[0].stop
    weighed = plan_parts(n, seq_lens, 2, 0.0, samples, 2.5)[0].stop
    assert even == 32 and weighed < 24  # 32 rows of 3.5 against 32 tokens of chunks: the cut near 20



@pytest.mark.parametrize(("n", "seq_lens"), [
    ([1], [10]),  # one request cannot be cut
    ([1, 1, 1], [5, 5, 5]),  # too few tokens to be worth the hand-over
    ([2000, 1, 1, 1, 1, 1, 1, 1], [2000, 50, 50, 50, 50, 50, 50, 50]),  # one long prefill chunk
])
def test_steps_that_do_not_split_evenly_run_whole(n, seq_lens):
    assert plan_parts(np.asarray(n), np.asarray(seq_lens), 2, 0.01) is None


def test_one_part_is_no_split():
    assert plan_parts(np.ones(64, dtype=np.int64), np.full(64, 10), 1, 0.01) is None
    assert default_parts(1, "PASSIVE") == 1
    assert default_parts(2, "PASSIVE") == 2 and default_parts(64, "passive") == 2
    # Under the spinning policies a whole step is quick on a quiet machine: parts only when asked.
    assert default_parts(2, "") == 1 and default_parts(8, "ACTIVE") == 1


def test_each_pool_thread_computes_with_its_own_count_and_the_callers_stays():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        pool = StepPartPool([2, 1])
        try:
            seen = pool.map(lambda: (threading.current_thread().name, torch.get_num_threads()), [(), ()])
            assert seen == [("step-part-0", 2), ("step-part-1", 1)]
            assert torch.get_num_threads() == 3
            # A thread started after the pool takes the caller's count, not a part's.
            later = []
            t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
            t.start()
            t.join()
            assert later == [3]
        finally:
            pool.close()
    finally:
        torch.set_num_threads(before)


def test_a_part_that_raises_is_raised_once_every_part_has_ended():
    pool = StepPartPool([1, 1])
    ended = []
    try:
        def part(i):
            if i == 0:
                raise RuntimeError("part 0 failed")
            threading.Event().wait(0.2)
            ended.append(i)
            return i

        with pytest.raises(RuntimeError, match="part 0 failed"):
            pool.map(part, [(0,), (1,)])
        assert ended == [1]  # the other part had finished when the error came out
        assert pool.map(lambda i: i * 2, [(3,), (4,)]) == [6, 8]  # and the pool still serves
    finally:
        pool.close()


def test_pool_refuses_fewer_than_two_parts():
    with pytest.raises(ValueError, match="two or more parts"):
        StepPartPool([2])


def _requests(count=24, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(count):
        prompt = rng.integers(10, 1500, int(rng.integers(3, 90))).tolist()
        sampling = SamplingParams(max_tokens=int(rng.integers(4, 30)), temperature=0.0, ignore_eos=True)
        if i % 5 == 3:  # a few sampled rows with penalties and logprobs, so the steps also build logits
            sampling = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=i, logprobs=2,
                                      repetition_penalty=1.1, ignore_eos=True)
        reqs.append(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=sampling))
    return reqs


def _run(model_dir, parts, requests, **kw):
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.02, max_model_len=256,
                                 cpu_threads=2, cpu_step_parts=parts, **kw))
    results = engine.generate(requests)
    out = {rid: (list(r.output_token_ids), [lp.logprob for lp in (r.output_logprobs or [])]) for rid, r in results.items()}
    return out, engine.runner.num_split_steps


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_split_steps_give_the_tokens_of_whole_steps(tiny_model_dir, two_threads):
    requests = _requests()
    whole, whole_splits = _run(tiny_model_dir, 1, requests)
    split, splits = _run(tiny_model_dir, 2, requests)
    assert whole_splits == 0 and splits > 0
    assert {k: v[0] for k, v in split.items()} == {k: v[0] for k, v in whole.items()}
    for rid in whole:  # logprobs of the sampled rows: the same within float32 noise of batch size
        np.testing.assert_allclose(split[rid][1], whole[rid][1], rtol=1e-4, atol=1e-4)


def test_split_steps_with_chunked_prefills_and_preemption(tiny_llama_dir, two_threads):
    # A small token budget chunks the prompts, a small cache preempts: parts hold chunks and recomputes.
    requests = _requests(count=40, seed=1)
    kw = {"max_num_batched_tokens": 64, "max_num_seqs": 16}
    whole, _ = _run(tiny_llama_dir, 1, requests, **kw)
    split, splits = _run(tiny_llama_dir, 2, requests, **kw)
    assert splits > 0
    assert {k: v[0] for k, v in split.items()} == {k: v[0] for k, v in whole.items()}


def test_the_default_splits_from_two_threads_and_not_at_one(tiny_llama_dir, two_threads, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01, cpu_threads=2))
    assert engine.runner.step_parts is not None and engine.runner.step_parts.parts == 2
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01, cpu_threads=1))
    assert engine.runner.step_parts is None
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01, cpu_threads=2))
    assert engine.runner.step_parts is None
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01, cpu_threads=2, cpu_step_parts=2))
    assert engine.runner.step_parts is not None


def test_the_setting_is_refused_below_1():
    with pytest.raises(ValueError, match="cpu_step_parts"):
        EngineConfig(model="m", cpu_step_parts=0)
