"""Paged attention kernel vs its torch reference, under the Triton interpreter (fp32 and fp16)."""

import zlib

import pytest
import torch

from tokenmill.kernels.checks import (
    ATTENTION_CASES,
    TOLERANCE,
    AttentionCase,
    attention_error,
    make_attention_inputs,
    random_attention_cases,
)
from tokenmill.kernels.paged_attention import choose_num_splits, paged_attention, paged_attention_ref

DTYPES = [torch.float32, torch.float16]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(case, dtype):
    assert attention_error(case, dtype, "cpu") <= TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("case", random_attention_cases(seed=7, count=8), ids=lambda c: c.name)
def test_paged_attention_random_shapes(case):
    for dtype in DTYPES:
        assert attention_error(case, dtype, "cpu", seed=zlib.crc32(case.name.encode()) % 1000) <= TOLERANCE[dtype], (case, dtype)


def test_split_counts_agree():
    case = AttentionCase("splits", (1, 3, 1), (45, 20, 2), 4, 2, 32, 8)
    inputs = make_attention_inputs(case, torch.float32, "cpu")
    outs = [paged_attention(**inputs, scale=0.2, num_splits=s, block_n=16) for s in (1, 2, 5)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=0)


def test_tile_shapes_do_not_change_the_result():
    case = AttentionCase("tiles", (7, 1, 12), (5, 30, 0), 6, 2, 32, 4)
    inputs = make_attention_inputs(case, torch.float32, "cpu")
    ref = paged_attention_ref(**inputs, scale=0.3)
    for block_m, block_n in [(16, 16), (32, 16), (64, 32)]:
        out = paged_attention(**inputs, scale=0.3, block_m=block_m, block_n=block_n)
        assert (out - ref).abs().max().item() <= 1e-5, (block_m, block_n)


def test_unused_cache_blocks_are_never_read():
    """NaN in every block outside the rows' tables (and past seq_len) must not reach the output."""
    case = AttentionCase("poison", (1, 4), (9, 3), 2, 1, 16, 4)
    inputs = make_attention_inputs(case, torch.float32, "cpu", extra_blocks=4)
    used = set()
    for b, seq_len in enumerate(inputs["seq_lens"].tolist()):
        n = -(-seq_len // 4)
        used.update(inputs["block_tables"][b, :n].tolist())
        last = inputs["block_tables"][b, n - 1].item()
        for cache in (inputs["key_cache"], inputs["value_cache"]):
            cache[last, seq_len - (n - 1) * 4 :] = float("nan")  # tail of the last block
    for blk in range(inputs["key_cache"].shape[0]):
        if blk not in used:
            inputs["key_cache"][blk] = float("nan")
            inputs["value_cache"][blk] = float("nan")
    out = paged_attention(**inputs, scale=0.25, block_n=16)
    assert torch.isfinite(out).all()
    ref = paged_attention_ref(**inputs, scale=0.25)
    assert (out - ref).abs().max().item() <= 1e-5


def test_empty_batch_returns_empty():
    case = AttentionCase("one", (1,), (3,), 2, 2, 16, 4)
    inputs = make_attention_inputs(case, torch.float32, "cpu")
    inputs["query"] = inputs["query"][:0]
    inputs["seq_lens"] = inputs["seq_lens"][:0]
    inputs["block_tables"] = inputs["block_tables"][:0]
    inputs["query_start_loc"] = inputs["query_start_loc"][:1]
    assert paged_attention(**inputs, scale=1.0).shape == (0, 2, 16)


def test_bad_inputs_raise_clear_errors():
    case = AttentionCase("bad", (2,), (3,), 4, 2, 16, 4)
    inputs = make_attention_inputs(case, torch.float32, "cpu")
    with pytest.raises(ValueError, match="int32"):
        paged_attention(**{**inputs, "seq_lens": inputs["seq_lens"].long()}, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(**{**inputs, "query": torch.zeros(2, 3, 16)}, scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(**{**inputs, "query": inputs["query"].half()}, scale=1.0)
    with pytest.raises(ValueError, match="metadata sizes"):
        paged_attention(**{**inputs, "query_start_loc": inputs["query_start_loc"][:1]}, scale=1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**inputs, scale=1.0, num_splits=0)
    with pytest.raises(ValueError, match="more blocks than block_tables"):
        paged_attention(**inputs, scale=1.0, max_seq_len=inputs["block_tables"].shape[1] * 4 + 1)


def test_no_split_on_cpu_or_short_contexts():
    assert choose_num_splits(1, 100_000, torch.device("cpu")) == 1
