"""The CPU KV cache is not zeroed at start: no attention path may read a slot its sequence has not
written. Filled with NaN before the first request, a cache must give the same tokens, logprobs and
prompt scores as one filled with zeros, through every path (C kernel rows, the torch decode buckets
with their padded lanes, SDPA prefill, chunked prefill, prefix-cache hits, forked n > 1 choices);
and a large cache must not be mapped (or zeroed) when the engine starts."""

import math

import pytest

from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams


def _requests() -> list[EngineRequest]:
    shared = [7 + (i * 5) % 90 for i in range(40)]  # a prefix two requests share (prefix cache hit)

    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)

    prompts = {
        "short": [11, 12, 13],
        "odd": [20 + i % 50 for i in range(17)],
        "shared-a": shared + [3, 4, 5],
        "long": [30 + (i * 7) % 200 for i in range(600)],  # past the C kernel's prefill length: SDPA
    }
    requests = [EngineRequest(request_id=name, prompt_token_ids=p, sampling=greedy(6 + len(p) % 5))
                for name, p in prompts.items()]
    requests.append(EngineRequest(request_id="n3", prompt_token_ids=[40 + i for i in range(21)], sampling=SamplingParams(
        max_tokens=7, temperature=0.9, seed=5, n=3, ignore_eos=True, logprobs=1)))
    requests.append(EngineRequest(request_id="score", prompt_token_ids=[50 + i % 30 for i in range(45)], sampling=SamplingParams(
        max_tokens=0, prompt_logprobs=1, score_from=2)))
    return requests


def _run(fill: float, **options) -> dict:
    engine = Engine(EngineConfig(model=options.pop("model"), dtype="float32", kv_cache_gb=0.02,
                                 max_num_batched_tokens=64, **options))
    for key_cache, value_cache in engine.runner.kv_caches:
        key_cache.fill_(fill)
        value_cache.fill_(fill)
    first = engine.generate(_requests())
    # After them, a request that hits the first one's cached prefix and decodes beside nothing else.
    late = engine.generate([EngineRequest(request_id="shared-b", prompt_token_ids=_requests()[2].prompt_token_ids[:40]
                                          + [9, 9], sampling=SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True, logprobs=2))])
    assert late["shared-b"].usage.cached_prompt_tokens >= 32
    return {**first, **late}


def _summary(deltas: dict) -> dict:
    out = {}
    for rid, d in deltas.items():
        assert d.error is None, (rid, d.error)
        logprobs = [(t.token_id, t.logprob, tuple(t.top_logprobs)) for t in d.output_logprobs or []]
        choices = [(c.token_ids, [(t.token_id, t.logprob) for t in c.logprobs or []]) for c in d.choices or []]
        scores = [(p.token_id, p.logprob, p.rank) for p in d.prompt_logprobs or []]
        for value in [lp for _, lp, _ in logprobs] + [lp for _, lp, _ in scores] + [
                lp for _, lps in choices for _, lp in lps]:
            assert math.isfinite(value), (rid, value)
        out[rid] = (d.output_token_ids, logprobs, choices, scores)
    return out


@pytest.mark.parametrize("path", [
    {},  # the C kernel for decode rows and short prefills (the default where it builds)
    {"cpu_attention_kernel": "off"},  # torch's decode buckets: rows of unequal length pad their lanes
])
def test_a_cache_full_of_nan_gives_what_a_zeroed_cache_gives(tiny_llama_dir, path):
    zeroed = _summary(_run(0.0, model=str(tiny_llama_dir), **path))
    poisoned = _summary(_run(float("nan"), model=str(tiny_llama_dir), **path))
    assert poisoned == zeroed
    assert len(poisoned["score"][3]) == 43 and len(poisoned["n3"][2]) == 3


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_large_cache_is_not_mapped_when_the_engine_starts(tiny_llama_dir):
    Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02))  # imports, kernels: warm
    before = _resident_bytes()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=1.0))
    grown = _resident_bytes() - before
    cache = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    assert cache >= 0.9 * 2**30
    assert grown < 0.2 * cache, f"the engine's start mapped {grown / 2**20:.0f} MiB of a {cache / 2**20:.0f} MiB cache"
