"""Prefill attention on AMX tiles (kernels/cpu/amx_prefill_attention.py): as close to float64 as
torch's SDPA or closer, for fresh prompts and chunks after context, blocks out of order, GQA; and the
torch backend hands it the long prefill rows of a mixed step. Needs a CPU with AMX."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.attention import AttentionMetadata
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend, build_plan
from tokenmill.kernels.cpu import amx_prefill_attention
from tokenmill.kernels.cpu.paths import CpuPaths

needs_amx = pytest.mark.skipif(not amx_prefill_attention.available(), reason="this CPU has no AMX tiles (bf16)")


def _cache(n_blocks, block_size, kv_heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_blocks, block_size, kv_heads, d, generator=g),
            torch.randn(n_blocks, block_size, kv_heads, d, generator=g))


def _sdpa(q, keys, values, context, scale):
    tokens, length = q.shape[0], keys.shape[0]
    seen = torch.arange(length)[None, :] <= (context + torch.arange(tokens))[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                          attn_mask=seen, scale=scale, enable_gqa=True).transpose(0, 1)


@needs_amx
@pytest.mark.parametrize("context,tokens,heads,kv_heads,d", [
    (0, 32, 4, 2, 32), (0, 45, 9, 3, 64), (0, 300, 9, 3, 64), (70, 33, 6, 2, 64), (500, 130, 8, 8, 128),
])
def test_as_close_to_float64_as_sdpa(context, tokens, heads, kv_heads, d):
    block_size = 16
    length = context + tokens
    n_blocks = -(-length // block_size)
    key_cache, value_cache = _cache(3 * n_blocks, block_size, kv_heads, d, seed=tokens)
    g = torch.Generator().manual_seed(context)
    table = torch.randperm(3 * n_blocks, generator=g)[:n_blocks].to(torch.int32)
    query = torch.randn(tokens + 7, heads, d, generator=g) * 2
    out = torch.full((tokens + 7, heads, d), 9.0)
    amx_prefill_attention.prefill_attention(query, key_cache, value_cache, table, 7, tokens, context, out, d**-0.5)
    assert bool((out[:7] == 9.0).all())  # other tokens' rows untouched
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
    keys, values = key_cache.view(-1, kv_heads, d)[slots], value_cache.view(-1, kv_heads, d)[slots]
    want = amx_prefill_attention.reference(query[7:], keys, values, context, d**-0.5)
    err = (out[7:].double() - want).abs().max().item()
    sdpa_err = (_sdpa(query[7:], keys, values, context, d**-0.5).double() - want).abs().max().item()
    assert err <= max(1.5 * sdpa_err, 1e-6)
    # A token that could see a later key would be far off: the first token sees `context + 1` keys.
    assert torch.allclose(out[7].double(), want[0], atol=1e-5)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_in_one_call_give_each_row_the_bits_of_its_own_call(threads):
    # Rows of unequal length (a fresh prompt, chunks after context, a long one, one of 32 tokens),
    # their tokens in a different order from their block table rows, with gaps between them.
    block_size, kv_heads, heads, d = 16, 2, 6, 64
    key_cache, value_cache = _cache(160, block_size, kv_heads, d, seed=3)
    specs = [(40, 0), (33, 70), (300, 0), (32, 200), (90, 5)]  # (tokens, context)
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(160, generator=g).to(torch.int32)
    width = 40
    tables = torch.zeros(len(specs) + 1, width, dtype=torch.int32)
    rows, start, used = [], 3, 0
    for i, (tokens, context) in enumerate(specs):
        n_blocks = -(-(tokens + context) // block_size)
        table_row = len(specs) - i  # row 0 of the table is unused
        tables[table_row, :n_blocks] = perm[used:used + n_blocks]
        used += n_blocks
        rows.append((start, table_row, tokens, context))
        start += tokens + 2
    query = torch.randn(start, heads, d, generator=g) * 2
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((start, heads, d), 9.0)
        amx_prefill_attention.prefill_attention_rows(query, key_cache, value_cache, tables, amx_prefill_attention.prefill_rows(rows),
                                               out, d**-0.5)
        one_by_one = torch.full((start, heads, d), 9.0)
        for first, table_row, tokens, context in rows:
            amx_prefill_attention.prefill_attention(query, key_cache, value_cache, tables[table_row].contiguous(), first,
                                              tokens, context, one_by_one, d**-0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, one_by_one)
    written = torch.zeros(start, dtype=torch.bool)
    for first, table_row, tokens, context in rows:
        written[first:first + tokens] = True
        slots = (tables[table_row, :-(-(tokens + context) // block_size)].long()[:, None] * block_size
                 + torch.arange(block_size)).reshape(-1)[:tokens + context]
        want = amx_prefill_attention.reference(query[first:first + tokens], key_cache.view(-1, kv_heads, d)[slots],
                                         value_cache.view(-1, kv_heads, d)[slots], context, d**-0.5)
        torch.testing.assert_close(out[first:first + tokens].double(), want, atol=2e-6, rtol=1e-5)
    assert bool((out[~written] == 9.0).all())  # the gaps between the rows untouched


def test_the_rows_table_is_checked():
    query = torch.zeros(4, 2, 32)
    cache = torch.zeros(4, 16, 1, 32)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        amx_prefill_attention.prefill_attention_rows(query, cache, cache, tables, torch.zeros(1, 4, dtype=torch.int32),
                                               torch.zeros_like(query), 1.0)
    with pytest.raises(ValueError, match="int32"):
        amx_prefill_attention.prefill_attention_rows(query, cache, cache, tables.long(), amx_prefill_attention.prefill_rows([(0, 0, 4, 0)]),
                                               torch.zeros_like(query), 1.0)


@needs_amx
def test_the_backend_sends_long_prefill_rows_to_it_and_keeps_the_rest():
    block_size, kv_heads, heads, d = 16, 2, 4, 64
    key_cache, value_cache = _cache(64, block_size, kv_heads, d, seed=1)
    # Rows: a decode row (context 40), a fresh prompt of 50 tokens, a chunk of 5 tokens after 30.
    q_lens, seq_lens = [1, 50, 5], [41, 50, 35]
    starts = [0, 1, 51, 56]
    tables = torch.tensor([list(range(0, 8)), list(range(8, 16)), list(range(16, 24))], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(56, dtype=torch.long), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), block_tables=tables, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        max_query_len=50, max_seq_len=50,
    )
    plan = build_plan(meta, block_size, kv_heads, use_kernel=True, num_blocks=64, use_amx_prefill=True)
    assert plan.amx_prefill == [(1, 1, 50, 0)]
    assert plan.kernel_rows.token_index.tolist() == [0, 51, 52, 53, 54, 55]

    query = torch.randn(56, heads, d, generator=torch.Generator().manual_seed(2))
    backend = TorchAttentionBackend()
    got = backend.attend(query, key_cache, value_cache, meta, d**-0.5)
    for row, (start, q_len, seq_len) in enumerate(zip(starts, q_lens, seq_lens, strict=False)):
        slots = (tables[row].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:seq_len]
        want = amx_prefill_attention.reference(query[start:start + q_len], key_cache.view(-1, kv_heads, d)[slots],
                                         value_cache.view(-1, kv_heads, d)[slots], seq_len - q_len, d**-0.5)
        torch.testing.assert_close(got[start:start + q_len].double(), want, atol=2e-6, rtol=1e-5)


def test_small_head_sizes_and_a_cpu_without_amx_keep_the_other_kernels(monkeypatch):
    assert not amx_prefill_attention.applies(48)
    monkeypatch.setattr(amx_prefill_attention.amx_gemm, "available", lambda: False)
    assert not amx_prefill_attention.applies(64)
    # The engine's paths without the AMX GEMM (amx_gemm off) hand the backend no AMX prefill.
    assert not TorchAttentionBackend(CpuPaths(decode_attention=True)).use_amx_prefill
