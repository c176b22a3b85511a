"""Greedy output of the engine equals transformers `generate`, token for token (fp32, CPU).

For each architecture, one engine run of 32 prompts of mixed length (crossing block boundaries) is
compared with Hugging Face `generate(do_sample=False)` run per prompt, and again with preemption
forced by a tiny KV budget, with chunked prefill forced by a tiny token budget, on a second pass
served from the prefix cache, and with every CPU path setting off.
"""

import random

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams
from tokenmill.kernels.cpu.paths import SETTINGS as CPU_PATH_SETTINGS
from tokenmill.kernels.cpu.paths import CpuPaths
from tokenmill.tools.tiny_models import cached_tiny_model

NUM_PROMPTS = 32
# "tiny-llama" (untied, vocab 32000) rather than the tied 64-wide test-llama: with random tied
# embeddings a greedy Llama just repeats its last token, which would hide attention bugs.
PRESETS = {"llama": "tiny-llama", "qwen2": "test-qwen2", "qwen3": "test-qwen3", "smollm2": "smollm2"}


def model_dir_for(arch):
    if arch == "smollm2":
        from tokenmill.tools.smollm2 import cached_smollm2

        return cached_smollm2()
    return cached_tiny_model(PRESETS[arch])


def make_prompts(vocab: int, seed: int = 0, max_len: int = 90, max_new: int = 20):
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 31, 32, 33, 64] + [rng.randint(2, max_len) for _ in range(NUM_PROMPTS - 8)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    new = [rng.randint(1, max_new) for _ in range(NUM_PROMPTS)]
    return prompts, new


def hf_reference(model_dir, prompts, max_new, eos=False):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p, n in zip(prompts, max_new, strict=True):
            kwargs = {} if eos else {"eos_token_id": None}
            seq = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs,
            )
            outs.append(seq[0, len(p):].tolist())
    return outs


@pytest.fixture(
    scope="module",
    params=[pytest.param(a, marks=pytest.mark.slow) if a == "smollm2" else a for a in sorted(PRESETS)],
)
def case(request):
    model_dir = model_dir_for(request.param)
    from tokenmill.engine.model_config import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    # The real model (30 layers) gets shorter runs to keep the suite quick on 2 cores.
    small = request.param == "smollm2"
    prompts, max_new = make_prompts(vocab, max_len=40 if small else 90, max_new=8 if small else 20)
    return {
        "arch": request.param,
        "dir": model_dir,
        "prompts": prompts,
        "max_new": max_new,
        "ref": hf_reference(model_dir, prompts, max_new),
    }


def requests(case, prefix="r", ignore_eos=True):
    return [
        EngineRequest(
            request_id=f"{prefix}{i}",
            prompt_token_ids=p,
            sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos),
        )
        for i, (p, n) in enumerate(zip(case["prompts"], case["max_new"], strict=True))
    ]


def outputs(results, prefix="r"):
    return [results[f"{prefix}{i}"].output_token_ids for i in range(NUM_PROMPTS)]


def kv_gb_for_blocks(engine_dir, num_blocks, block_size=16):
    from tokenmill.engine.model_config import load_model_config

    mc = load_model_config(engine_dir, "float32")
    per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, block_size)
    return num_blocks * per_block / 1024**3


def test_greedy_matches_transformers_and_second_pass_hits_prefix_cache(case):
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb_for_blocks(case["dir"], 400)))
    first = engine.generate(requests(case, "a"))
    assert outputs(first, "a") == case["ref"]
    assert all(d.finish_reason is FinishReason.LENGTH for d in first.values())
    assert engine.stats().cached_prompt_tokens_total == 0
    # (c) the same prompts again: full blocks come from the prefix cache, output unchanged.
    second = engine.generate(requests(case, "b"))
    assert outputs(second, "b") == case["ref"]
    cached = [second[f"b{i}"].usage.cached_prompt_tokens for i in range(NUM_PROMPTS)]
    assert sum(cached) > 0 and engine.stats().cached_prompt_tokens_total == sum(cached)
    for p, c in zip(case["prompts"], cached, strict=True):
        assert c == (len(p) - 1) // 16 * 16  # every full block but never the last prompt token
    assert engine.metrics.prompt_tokens_computed == sum(len(p) for p in case["prompts"]) * 2 - sum(cached)


def test_greedy_matches_transformers_under_preemption(case):
    # 8 blocks of 16 slots for 32 sequences of up to 110 tokens (7 blocks): they cannot all run at once.
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32", kv_cache_gb=kv_gb_for_blocks(case["dir"], 8)))
    res = engine.generate(requests(case))
    assert engine.metrics.num_preemptions > 0
    assert outputs(res) == case["ref"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_matches_transformers_with_chunked_prefill(case):
    engine = Engine(
        EngineConfig(
            model=str(case["dir"]), dtype="float32", max_num_batched_tokens=7,
            kv_cache_gb=kv_gb_for_blocks(case["dir"], 400), enable_prefix_caching=False,
        )
    )
    steps_with_partial_prefill = 0
    for r in requests(case):
        engine.add(r)
    results = {}
    while engine.has_work():
        for d in engine.step():
            if d.finished:
                results[d.request_id] = d
        last = engine.metrics.last_step
        assert last["tokens"] <= 7
        if any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            steps_with_partial_prefill += 1
    assert steps_with_partial_prefill > 0
    assert outputs(results) == case["ref"]


def test_greedy_matches_transformers_with_every_cpu_path_off(case):
    """The settings' other way: no C kernel, no oneDNN or AMX GEMM, no greedy screen, no huge pages or
    malloc tuning (the default runs above take every path that runs here)."""
    off = {name: "off" for name in (*CPU_PATH_SETTINGS, "huge_pages", "malloc_tuning")}
    engine = Engine(EngineConfig(model=str(case["dir"]), dtype="float32",
                                 kv_cache_gb=kv_gb_for_blocks(case["dir"], 400), **off))
    assert engine.cpu_paths == CpuPaths(onednn_layers=False)
    assert outputs(engine.generate(requests(case))) == case["ref"]


@pytest.mark.parametrize("arch", ["qwen2"])
def test_eos_stops_like_transformers(arch):
    model_dir = cached_tiny_model(PRESETS[arch])
    prompts, _ = make_prompts(2048, seed=5)
    max_new = [40] * NUM_PROMPTS
    ref = hf_reference(model_dir, prompts, max_new, eos=True)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=kv_gb_for_blocks(model_dir, 400)))
    case = {"prompts": prompts, "max_new": max_new}
    res = engine.generate(requests(case, ignore_eos=False))
    got = outputs(res)
    assert got == ref
    eos = set(engine.eos_token_ids)
    for out, d in zip(got, (res[f"r{i}"] for i in range(NUM_PROMPTS)), strict=True):
        expected = FinishReason.STOP if out and out[-1] in eos else FinishReason.LENGTH
        assert d.finish_reason is expected
