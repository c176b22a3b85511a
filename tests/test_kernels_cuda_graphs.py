"""Decode-graph runner's padded path (eager on the CPU: graph capture itself needs CUDA).

Padding a decode batch up to a captured size must not change the real rows' logits nor write
anything to the KV cache for the padding rows.
"""

import pytest
import torch

from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
from tokenmill.engine.cuda_graphs import DecodeGraphRunner
from tokenmill.engine.loader import load_model

BLOCK = 4


def _meta(rows, tables, width):
    """rows: (context_len, new_len) per sequence; tables: block ids per sequence."""
    qsl, seq_lens, slots = [0], [], []
    for (ctx, new), table in zip(rows, tables, strict=True):
        qsl.append(qsl[-1] + new)
        seq_lens.append(ctx + new)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + new)]
    bt = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        bt[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt, slot_mapping=torch.tensor(slots), max_query_len=max(n for _, n in rows),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )


@pytest.fixture(scope="module")
def prefilled(tiny_llama_dir):
    model, cfg = load_model(tiny_llama_dir, dtype="float32", device="cpu", attention_backend=TritonAttentionBackend())
    shape = (16, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    tables = [[9, 2], [5], [14, 0, 7]]  # scattered blocks; block 0 is in use (padding rows read it)
    prompts = [[5, 6, 7, 8, 9], [100, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    meta = _meta([(0, len(p)) for p in prompts], tables, width=3)
    ids = torch.tensor(sum(prompts, []))
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    model(ids, pos, meta, kv)
    return model, kv, tables, [len(p) for p in prompts]


@pytest.mark.slow
def test_padded_decode_equals_exact_decode_and_padding_writes_nothing(prefilled):
    model, kv, tables, lens = prefilled
    rows = [(n, 1) for n in lens]
    meta = _meta(rows, tables, width=3)
    ids = torch.tensor([11, 12, 13])
    pos = torch.tensor(lens)

    exact_kv = [(k.clone(), v.clone()) for k, v in kv]
    exact = model.compute_logits(model(ids, pos, meta, exact_kv))

    padded_kv = [(k.clone(), v.clone()) for k, v in kv]
    runner = DecodeGraphRunner(model, padded_kv, max_blocks_per_seq=4, batch_sizes=(2, 8), use_graphs=False)
    assert runner.padded_size(3) == 8
    logits = runner.run(ids, pos, meta)
    assert logits.shape == exact.shape
    torch.testing.assert_close(logits, exact, atol=1e-5, rtol=0)
    # The new K/V of the real rows match to rounding (a batch of 8 rows may round its matmuls
    # differently from a batch of 3); every other slot, block 0 included, is untouched.
    written = meta.slot_mapping
    for (ek, ev), (pk, pv), (k0, v0) in zip(exact_kv, padded_kv, kv, strict=True):
        for exact_c, padded_c, before in ((ek, pk, k0), (ev, pv, v0)):
            e, p, b = (c.view(-1, *c.shape[2:]) for c in (exact_c, padded_c, before))
            torch.testing.assert_close(p[written], e[written], atol=1e-5, rtol=0)
            others = torch.ones(e.shape[0], dtype=torch.bool)
            others[written] = False
            assert torch.equal(p[others], b[others])

    # A second, smaller batch reuses the buffers: stale rows from the first must not leak in.
    meta2 = _meta(rows[1:2], tables[1:2], width=1)
    logits2 = runner.run(ids[1:2], pos[1:2], meta2)
    exact_kv2 = [(k.clone(), v.clone()) for k, v in kv]
    exact2 = model.compute_logits(model(ids[1:2], pos[1:2], meta2, exact_kv2))
    torch.testing.assert_close(logits2, exact2, atol=1e-5, rtol=0)


def test_runner_refuses_what_it_cannot_run(prefilled):
    model, kv, tables, lens = prefilled
    runner = DecodeGraphRunner(model, kv, max_blocks_per_seq=4, batch_sizes=(2,), use_graphs=False)
    prefill = _meta([(0, 3)], [[1]], width=1)
    assert not runner.can_run(prefill)
    with pytest.raises(ValueError, match="not a decode batch"):
        runner.run(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), prefill)
    too_many = _meta([(n, 1) for n in lens], tables, width=3)
    assert not runner.can_run(too_many)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(model, kv, max_blocks_per_seq=4, use_graphs=True)
