"""Section `decode_step`: the ~1B Llama's decode step at each batch, eager and replayed as a CUDA
graph, against its roofline (weight bytes + KV bytes read, over copy bandwidth)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.roofline import param_bytes
from tokenmill.tools.gpu_check.timing import time_ms

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def _load_engine_model(ctx: Context):
    from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
    from tokenmill.engine.loader import load_model

    return load_model(ctx.model_dir(), dtype=ctx.sizes.model_dtype, device=ctx.device,
                      attention_backend=TritonAttentionBackend())


def section_decode_step(ctx: Context) -> dict:
    import torch

    from tokenmill.engine.attention import AttentionMetadata
    from tokenmill.engine.cuda_graphs import DecodeGraphRunner

    copy_bw = ctx.copy_bandwidth()
    model, config = _load_engine_model(ctx)
    weights = param_bytes(model)
    bs = ctx.sizes.block_size
    elt = torch.empty((), dtype=config.dtype).element_size()
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * elt
    runs = []
    for batch in ctx.sizes.decode_batches:
        seq_len = ctx.sizes.decode_context + 1
        blocks_per_seq = math.ceil(seq_len / bs)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, bs, config.num_kv_heads, config.head_dim)
        kv_caches = [(torch.randn(shape, dtype=config.dtype, device=ctx.device),
                      torch.randn(shape, dtype=config.dtype, device=ctx.device)) for _ in range(config.num_layers)]
        block_tables = torch.arange(num_blocks, dtype=torch.int32, device=ctx.device).view(batch, blocks_per_seq)
        positions = torch.full((batch,), seq_len - 1, dtype=torch.long, device=ctx.device)
        slots = (block_tables[:, (seq_len - 1) // bs].long() * bs + (seq_len - 1) % bs)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=ctx.device),
            seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device),
            block_tables=block_tables, slot_mapping=slots, max_query_len=1, max_seq_len=seq_len,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[seq_len] * batch,
        )
        input_ids = torch.randint(0, config.vocab_size, (batch,), device=ctx.device)

        step_args = (input_ids, positions, meta, kv_caches)
        ms = time_ms(lambda a=step_args: model.compute_logits(model(*a)), ctx.device, iters=ctx.sizes.bench_iters)
        step_bytes = weights + batch * seq_len * kv_bytes_per_token
        roofline_ms = step_bytes / copy_bw * 1e3
        run = dict(batch=batch, context=ctx.sizes.decode_context, step_ms=ms, roofline_ms=roofline_ms,
                   roofline_over_step=roofline_ms / ms, bytes_per_step=step_bytes, tokens_per_s=batch / (ms / 1e3))
        # The same step replayed as a CUDA graph (on the CPU: the runner's eager padded path).
        try:
            graphs = DecodeGraphRunner(model, kv_caches, max_blocks_per_seq=blocks_per_seq, batch_sizes=(batch,))
            graphs.capture()
            graph_ms = time_ms(lambda g=graphs, a=step_args[:3]: g.run(*a), ctx.device, iters=ctx.sizes.bench_iters)
            run.update(graph_step_ms=graph_ms, graph_roofline_over_step=roofline_ms / graph_ms,
                       graph_tokens_per_s=batch / (graph_ms / 1e3))
        except Exception as exc:
            run["graph_error"] = f"{type(exc).__name__}: {exc}"
        runs.append(run)
    return dict(weight_bytes=weights, kv_bytes_per_token=kv_bytes_per_token, runs=runs)
