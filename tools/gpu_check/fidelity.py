"""Section `fidelity`: greedy tokens of the engine's GPU path against transformers and against the
plain engine, before any timing."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.checkpoints import build_checkpoint
from tokenmill.tools.gpu_check.context import release_memory
from tokenmill.tools.gpu_check.engine_path import gpu_path_options, gpu_path_report

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_fidelity(ctx: Context) -> dict:
    """Greedy tokens of the engine's GPU path against transformers and against the plain engine.

    fp32, a small seeded random Llama, prompts of mixed length run as one batch. Three runs: the
    engine with CUDA graphs + async scheduling (as `auto` picks on CUDA), the engine with both off,
    and transformers `generate` one prompt at a time (no padding). On a GPU, bit-exact agreement is
    not guaranteed (padded graph batches and different GEMM shapes may round differently), so the
    counts are reported for reading, with the first position where a sequence differs; the section
    fails only if it cannot run. On the CPU (dry run) all three agree exactly (the suite checks it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    sizes = ctx.sizes
    model_dir = build_checkpoint(sizes.fidelity_shape, "float32", ctx.device, ctx.workdir / "fidelity_model")
    rng = random.Random(11)
    lo, hi = sizes.fidelity_prompt_range
    vocab = sizes.fidelity_shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(sizes.fidelity_prompts)]
    new = sizes.fidelity_tokens

    def engine_tokens(**gpu_path) -> tuple[list[list[int]], dict]:
        engine = Engine(EngineConfig(
            model=str(model_dir), device=str(ctx.device), dtype="float32", attention_backend="triton",
            max_num_seqs=max(len(prompts), 2), kv_cache_gb=0.25 if ctx.device.type == "cuda" else 0.02, **gpu_path,
        ))
        requests = [EngineRequest(request_id=f"f{i}", prompt_token_ids=p,
                                  sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        done = engine.generate(requests)
        tokens = [list(done[f"f{i}"].output_token_ids) for i in range(len(prompts))]
        path = gpu_path_report(engine)
        del engine
        release_memory(ctx.device)
        return tokens, path

    fast, path = engine_tokens(**gpu_path_options(ctx.device))
    plain, _ = engine_tokens(cuda_graphs="off", async_scheduling="off")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ctx.device).eval()
    reference = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=ctx.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            reference.append(out[0, len(p):].tolist())
    del model
    return dict(prompts=len(prompts), tokens_each=new, prompt_tokens=sum(map(len, prompts)),
                gpu_path_vs_transformers=agreement(fast, reference), plain_vs_transformers=agreement(plain, reference),
                gpu_path_vs_plain=agreement(fast, plain), **path)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences are equal, and where each of the others first differs."""
    first = [next((j for j, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
             for s, t in zip(a, b, strict=True)]
    return dict(equal=sum(f is None for f in first), of=len(first),
                first_difference_at=[f for f in first if f is not None])
