"""Batch invariance of the Triton kernels, under the Triton interpreter: a query token's attention output
is the same bits alone, among other rows (short, long, decode, prefill), as part of a whole prompt or
of a chunk, whatever split count the launch needs (keys cut at fixed multiples, splits merged in
order); the element-wise kernels give a row the same bits at any row count.

The interpreter computes tl.dot with numpy's matmul, whose BLAS kernel (OpenBLAS) rounds a row of a
tile differently by where the row sits in it (rows 12 apart agree, the others differ in the last bit),
while a GPU's dot takes the same steps for every row of a tile (each output an in-order chain over
k). The attention tests give the interpreter such a dot (`ordered_dot`), so that what they check is
the kernel's own order: which keys go into which tile and split, and in which order splits merge.
tools/gpu_check's `invariance` section checks the same on a GPU with its own dot."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter

from tokenmill.kernels.paged_attention import paged_attention, paged_attention_ref
from tokenmill.kernels.rmsnorm import rms_norm
from tokenmill.kernels.rotary import rope_cos_sin_cache, rotary_embedding
from tokenmill.kernels.silu_mul import silu_mul

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 4
SPLIT_KEYS, BLOCK_N = 32, 16  # small cuts keep the interpreter quick and still split these rows


class Sequences:
    """Token streams whose K/V (one per position) sit in a shared paged cache, blocks scattered; a
    row of a launch is (sequence, first new position, new tokens), its queries taken per position."""

    def __init__(self, lengths: list[int], dtype=torch.float32, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        blocks = [math.ceil(n / BLOCK) for n in lengths]
        pool = sum(blocks) + 2
        perm = torch.randperm(pool, generator=gen).tolist()
        self.tables, start = [], 0
        for n in blocks:
            self.tables.append(perm[start : start + n])
            start += n
        shape = (pool, BLOCK, KV_HEADS, HEAD_DIM)
        self.key_cache = torch.randn(shape, generator=gen).to(dtype)
        self.value_cache = torch.randn(shape, generator=gen).to(dtype)
        self.queries = [torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype) for n in lengths]

    def launch(self, rows: list[tuple[int, int, int]], **kwargs) -> torch.Tensor:
        """rows: (sequence, context, new tokens); returns the packed output."""
        width = max(len(t) for t in self.tables)
        tables = torch.zeros(len(rows), width, dtype=torch.int32)
        qsl, lens, queries = [0], [], []
        for i, (s, ctx, new) in enumerate(rows):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
            qsl.append(qsl[-1] + new)
            lens.append(ctx + new)
            queries.append(self.queries[s][ctx : ctx + new])
        inputs = dict(query=torch.cat(queries), key_cache=self.key_cache, value_cache=self.value_cache,
                      block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
                      query_start_loc=torch.tensor(qsl, dtype=torch.int32))
        self.last_inputs = inputs
        return paged_attention(**inputs, scale=HEAD_DIM**-0.5, block_n=BLOCK_N, **kwargs)


@pytest.fixture
def ordered_dot(monkeypatch):
    """The interpreter's tl.dot with every output summed over k in order (see the module docstring)."""

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = np.array(d.data, copy=True)
        for k in range(a.data.shape[-1]):
            acc += a.data[..., k : k + 1].astype(acc.dtype) * b.data[..., k : k + 1, :].astype(acc.dtype)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _invariant(seqs: Sequences, rows, **kwargs) -> torch.Tensor:
    return seqs.launch(rows, batch_invariant=True, split_keys=SPLIT_KEYS, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32], ids=str)  # the order under test is the same in every dtype
def test_a_token_gets_the_same_bits_alone_in_a_batch_in_its_prompt_and_in_a_chunk(dtype, ordered_dot):
    seqs = Sequences([75, 40, 9, 120, 33], dtype=dtype)
    target, pos = 0, 70  # sequence 0's token at position 70: its keys cross two split cuts
    alone = _invariant(seqs, [(target, pos, 1)])[0]
    assert torch.equal(_invariant(seqs, [(2, 8, 1), (target, pos, 1), (3, 100, 20), (1, 0, 40)])[1], alone)
    batch_rows = [(4, 0, 33), (target, pos, 1), (3, 119, 1)]
    assert torch.equal(_invariant(seqs, batch_rows)[33], alone)
    # The whole prompt up to the token in one row (the token last), and a chunk of it after context.
    assert torch.equal(_invariant(seqs, [(target, 0, pos + 1)])[pos], alone)
    assert torch.equal(_invariant(seqs, [(1, 30, 10), (target, 61, 12)])[10 + pos - 61], alone)
    # And every token of a prompt matches its own decode row.
    whole = _invariant(seqs, [(3, 0, 120), (1, 39, 1)])
    whole_inputs = seqs.last_inputs
    for p in (0, 5, 31, 32, 33, 64, 95, 119):
        assert torch.equal(whole[p], _invariant(seqs, [(3, p, 1)])[0]), p
    ref = paged_attention_ref(**{k: v.float() if v.is_floating_point() else v for k, v in whole_inputs.items()},
                              scale=HEAD_DIM**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (whole.float() - ref).abs().max().item() <= tol


def test_without_fixed_cuts_the_split_count_moves_the_bits(ordered_dot):
    """Why the cuts are fixed: a split count chosen by the launch changes a row's summation order."""
    seqs = Sequences([120, 9])
    outs = [seqs.launch([(0, 119, 1), (1, 8, 1)], num_splits=s)[0] for s in (1, 2, 3)]
    assert not all(torch.equal(o, outs[0]) for o in outs[1:])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)


def test_a_batch_invariant_launch_refuses_a_forced_split_count():
    seqs = Sequences([10])
    with pytest.raises(ValueError, match="num_splits cannot be forced"):
        seqs.launch([(0, 9, 1)], batch_invariant=True, num_splits=2)
    with pytest.raises(ValueError, match="multiple of the key tile"):
        seqs.launch([(0, 9, 1)], batch_invariant=True, split_keys=24)


def test_element_wise_kernels_give_a_row_the_same_bits_at_any_row_count():
    gen = torch.Generator().manual_seed(3)
    x, res = torch.randn(37, 200, generator=gen), torch.randn(37, 200, generator=gen)
    w = 1 + 0.1 * torch.randn(200, generator=gen)
    full, full_res = rms_norm(x, w, 1e-6, residual=res)
    gate_up = torch.randn(37, 2 * 96, generator=gen)
    full_silu = silu_mul(gate_up)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        one, one_res = rms_norm(x[rows], w, 1e-6, residual=res[rows])
        assert torch.equal(one, full[rows]) and torch.equal(one_res, full_res[rows])
        assert torch.equal(silu_mul(gate_up[rows]), full_silu[rows])
    table = rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)), 64)
    q, k = torch.randn(9, 4, 32, generator=gen), torch.randn(9, 2, 32, generator=gen)
    positions = torch.tensor([0, 3, 63, 7, 7, 1, 30, 31, 2])
    q_all, k_all = q.clone(), k.clone()
    rotary_embedding(positions, q_all, k_all, table)
    q_one, k_one = q[4:5].clone(), k[4:5].clone()
    rotary_embedding(positions[4:5], q_one, k_one, table)
    assert torch.equal(q_one, q_all[4:5]) and torch.equal(k_one, k_all[4:5])


@pytest.mark.slow
def test_an_engine_on_the_triton_backend_gives_a_request_the_same_bits_alone_and_in_a_chunked_batch(
        tiny_llama_dir, ordered_dot):
    """The engine end to end with the Triton attention (interpreted) and the fixed-order GEMMs: greedy and
    seeded requests with logprobs, each alone and all together with prompts cut into chunks."""
    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 23, 40, 17)]

    def requests():
        return [EngineRequest(request_id=f"r{i}", prompt_token_ids=p,
                              sampling=SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2,
                                                      temperature=0.0 if i % 2 else 0.9, seed=i))
                for i, p in enumerate(prompts)]

    def answer(d):
        return d.output_token_ids, [(lp.logprob, lp.top_logprobs) for lp in d.output_logprobs]

    def engine(**settings):
        return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", attention_backend="triton",
                                   kv_cache_gb=0.01, batch_invariant="on", **settings))

    alone_engine = engine()
    assert alone_engine.attention_backend.batch_invariant and alone_engine.batch_invariant
    alone = {r.request_id: answer(alone_engine.generate([r])[r.request_id]) for r in requests()}
    together = engine(max_num_batched_tokens=16).generate(requests())
    assert {rid: answer(d) for rid, d in together.items()} == alone
