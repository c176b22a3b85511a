"""Section `invariance`: the paged-attention kernel's batch-invariant launches on the GPU's own dot.

A query token's output must be the same bits alone, in a batch of other decode and prefill rows, as
a token of its whole prompt and of a chunk after context (kernels/paged_attention.py, "Batch
invariance"). Tokens whose keys cross split cuts are chosen on purpose. For contrast the same
comparison is made with the default launch, whose split count and tile height follow the batch: how
often it differs is what the invariant launch buys.

On the CPU (--dry-run) the interpreter computes tl.dot with numpy's BLAS, which rounds a tile's rows
differently by where they sit, so equality is reported but not required there
(tests/test_kernels_invariance.py checks the kernel's order under the interpreter with an in-order
dot)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.timing import dtype_of

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_invariance(ctx: Context) -> dict:
    import torch

    from tokenmill.kernels.paged_attention import paged_attention

    heads, kv_heads, head_dim = ctx.sizes.attention_heads
    dtype = dtype_of(ctx.sizes.model_dtype)
    bs = ctx.sizes.block_size
    lengths = list(ctx.sizes.invariance_lengths)
    split_keys = ctx.sizes.invariance_split_keys
    gen = torch.Generator(device="cpu").manual_seed(0)
    blocks = [math.ceil(n / bs) for n in lengths]
    perm = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, start = [], 0
    for n in blocks:
        tables.append(perm[start:start + n])
        start += n
    shape = (sum(blocks), bs, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(ctx.device)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(ctx.device)
    queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lengths]

    def launch(rows: list[tuple[int, int, int]], invariant: bool) -> torch.Tensor:
        """rows: (sequence, context, new tokens) -> the packed output, on the host."""
        width = max(len(t) for t in tables)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        qsl, lens, q = [0], [], []
        for i, (s, ctx_len, new) in enumerate(rows):
            table[i, :len(tables[s])] = torch.tensor(tables[s], dtype=torch.int32)
            qsl.append(qsl[-1] + new)
            lens.append(ctx_len + new)
            q.append(queries[s][ctx_len:ctx_len + new])
        dev = ctx.device
        out = paged_attention(torch.cat(q).to(dev), key_cache, value_cache, table.to(dev),
                              torch.tensor(lens, dtype=torch.int32, device=dev),
                              torch.tensor(qsl, dtype=torch.int32, device=dev), head_dim**-0.5,
                              batch_invariant=invariant, split_keys=split_keys if invariant else None)
        return out.cpu()

    # Sequence 0 is the target; the others are its neighbours: decode rows and prefill rows.
    target_len = lengths[0]
    positions = sorted({0, split_keys - 1, split_keys, target_len // 2, target_len - 1})
    neighbours = [(s, 0, lengths[s]) if s % 2 else (s, lengths[s] - 1, 1) for s in range(1, len(lengths))]
    chunk_start = max(0, target_len - ctx.sizes.invariance_chunk)
    checks = {"invariant": {"tokens": 0, "same": 0}, "default": {"tokens": 0, "same": 0}}
    for mode, invariant in (("invariant", True), ("default", False)):
        whole = launch([(0, 0, target_len)], invariant)
        chunk = launch([*neighbours, (0, chunk_start, target_len - chunk_start)], invariant)
        chunk_offset = sum(new for _, _, new in neighbours)
        for p in positions:
            alone = launch([(0, p, 1)], invariant)[0]
            crowded = launch([*neighbours, (0, p, 1)], invariant)[-1]
            views = [crowded, whole[p]]
            if p >= chunk_start:
                views.append(chunk[chunk_offset + p - chunk_start])
            checks[mode]["tokens"] += len(views)
            checks[mode]["same"] += sum(bool(torch.equal(v, alone)) for v in views)
    inv = checks["invariant"]
    ok = inv["same"] == inv["tokens"] or ctx.sizes.dry_run
    return dict(ok=ok, dtype=ctx.sizes.model_dtype, lengths=lengths, split_keys=split_keys, positions=positions,
                invariant_same=inv["same"], invariant_compared=inv["tokens"],
                default_same=checks["default"]["same"], default_compared=checks["default"]["tokens"],
                required=not ctx.sizes.dry_run)
