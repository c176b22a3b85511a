"""Section `attention`: paged-attention decode, KV bytes read per second as a fraction of copy
bandwidth."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.timing import dtype_of, time_kernel_ms

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_attention(ctx: Context) -> dict:
    import torch

    from tokenmill.kernels.paged_attention import paged_attention

    copy_bw = ctx.copy_bandwidth()
    heads, kv_heads, head_dim = ctx.sizes.attention_heads
    dtype = dtype_of(ctx.sizes.model_dtype)
    bs = ctx.sizes.block_size
    runs = []
    for label, batch, context, splits in ctx.sizes.attention_runs:
        seq_len = context + 1
        blocks_per_seq = math.ceil(seq_len / bs)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, bs, kv_heads, head_dim)
        key_cache = torch.randn(cache_shape, dtype=dtype, device=ctx.device)
        value_cache = torch.randn(cache_shape, dtype=dtype, device=ctx.device)
        perm = torch.randperm(num_blocks, device=ctx.device).to(torch.int32)  # scattered, as in a real pool
        block_tables = perm.view(batch, blocks_per_seq)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
        query = torch.randn((batch, heads, head_dim), dtype=dtype, device=ctx.device)

        args = (query, key_cache, value_cache, block_tables, seq_lens, qsl, head_dim**-0.5)
        hints = dict(max_query_len=1, max_seq_len=seq_len, num_splits=splits)
        ms = time_kernel_ms(lambda a=args, h=hints: paged_attention(*a, **h), ctx.device, iters=ctx.sizes.bench_iters)
        kv_bytes = 2 * batch * seq_len * kv_heads * head_dim * key_cache.element_size()
        moved = kv_bytes + 2 * query.numel() * query.element_size()  # + query read and output write
        runs.append(dict(label=label, batch=batch, context=context, forced_splits=splits, ms=ms,
                         bytes=moved, bytes_per_s=moved / (ms / 1e3), fraction_of_copy=moved / (ms / 1e3) / copy_bw))
    best = max(r["fraction_of_copy"] for r in runs)
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=ctx.sizes.model_dtype, runs=runs,
                best_fraction_of_copy=best)
