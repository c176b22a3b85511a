"""Section `throughput`: 256 sequences of random lengths through the engine on the 1B model:
output tokens/s and its fraction of the roofline ceiling."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.engine_path import gpu_path_report, make_engine
from tokenmill.tools.gpu_check.roofline import llama_param_count, roofline_ceiling
from tokenmill.tools.gpu_check.timing import dtype_of, synchronize

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_throughput(ctx: Context) -> dict:
    import torch

    from tokenmill.engine import EngineRequest, SamplingParams

    copy_bw = ctx.copy_bandwidth()
    rng = random.Random(2026)
    lo, hi = ctx.sizes.throughput_len_range
    n = ctx.sizes.throughput_seqs
    vocab = ctx.sizes.model_shape["vocab_size"]
    prompt_lens = [rng.randint(lo, hi) for _ in range(n)]
    output_lens = [rng.randint(lo, hi) for _ in range(n)]
    requests = [
        EngineRequest(
            request_id=f"t{i}",
            prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt_lens[i])],
            sampling=SamplingParams(max_tokens=output_lens[i], temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]
    engine = make_engine(ctx, ctx.model_dir())
    warm = EngineRequest(request_id="warmup", prompt_token_ids=[5] * 16,
                         sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.generate([warm])  # compile kernels outside the timed run
    synchronize(ctx.device)
    t0 = time.perf_counter()
    outputs = engine.generate(requests)  # request_id -> final delta
    synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.output_token_ids or []) for o in outputs.values())
    if produced != sum(output_lens):
        raise RuntimeError(f"engine produced {produced} tokens, expected {sum(output_lens)} (ignore_eos)")
    model_cfg = ctx.sizes.model_shape
    head_dim = model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    elt = torch.empty((), dtype=dtype_of(ctx.sizes.model_dtype)).element_size()
    kv_bytes_per_token = 2 * model_cfg["num_hidden_layers"] * model_cfg["num_key_value_heads"] * head_dim * elt
    weights = llama_param_count(model_cfg) * elt
    ceiling = roofline_ceiling(prompt_lens, output_lens, weights, kv_bytes_per_token, copy_bw,
                               ctx.sizes.max_num_seqs)
    tok_s = produced / seconds
    return dict(sequences=n, prompt_tokens=sum(prompt_lens), output_tokens=produced, seconds=seconds,
                output_tok_s=tok_s, ceiling_tok_s=ceiling["tokens_per_s"], ceiling_steps=ceiling["steps"],
                fraction_of_ceiling=tok_s / ceiling["tokens_per_s"], weight_bytes=weights,
                max_num_seqs=ctx.sizes.max_num_seqs, max_num_batched_tokens=ctx.sizes.max_num_batched_tokens,
                **gpu_path_report(engine))
