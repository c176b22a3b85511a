"""Kernel-vs-reference checks shared by the CPU test suite and tools/gpu_check.

One list of cases, two runners: pytest runs them under the Triton interpreter (fp32, fp16), and
gpu_check runs the same cases on CUDA with bf16 added (the interpreter computes bf16 wrongly).
Errors are measured against the reference evaluated in fp32 on the same (upcast) inputs, so the
numbers say how far the kernel is from exact, not from another rounded result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from tokenmill.kernels.kv_write import kv_write, kv_write_ref
from tokenmill.kernels.paged_attention import paged_attention, paged_attention_ref
from tokenmill.kernels.rmsnorm import rms_norm, rms_norm_ref
from tokenmill.kernels.rotary import rope_cos_sin_cache, rotary_embedding, rotary_embedding_ref
from tokenmill.kernels.silu_mul import silu_mul, silu_mul_ref

# Max error allowed against the fp32 reference, measured as |out - ref| / max(1, |ref|) per element:
# absolute for the O(1) values attention produces, relative for the larger ones an MLP can.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs() / ref.abs().clamp(min=1.0)).max().item()


@dataclass(frozen=True)
class AttentionCase:
    name: str
    q_lens: tuple[int, ...]  # new query tokens per row (1 = decode row)
    ctx_lens: tuple[int, ...]  # tokens already cached per row
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_splits: int = 1
    block_n: int | None = 16  # small key tiles keep the interpreter quick; None = the GPU default

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


# Small on purpose: the interpreter spends ~0.5 ms per program instance and per loop trip.
ATTENTION_CASES = [
    AttentionCase("decode_only_mha", (1, 1, 1), (0, 15, 16), 2, 2, 64, 16),
    AttentionCase("prefill_only_empty_context", (17, 1), (0, 0), 2, 2, 64, 16),
    AttentionCase("mixed_block_boundaries", (1, 16, 1, 3), (31, 16, 32, 13), 4, 4, 64, 16),
    AttentionCase("mixed_gqa3", (1, 9, 1), (40, 7, 0), 6, 2, 64, 8),
    AttentionCase("mixed_gqa7", (2, 1, 5), (3, 21, 0), 7, 1, 64, 8),
    AttentionCase("padded_head_dim_40", (1, 6, 1), (9, 2, 30), 6, 2, 40, 8),
    AttentionCase("padded_head_dim_24_gqa3", (4, 1), (11, 5), 3, 1, 24, 4),
    AttentionCase("head_dim_128", (1, 5), (19, 4), 2, 1, 128, 16),
    AttentionCase("many_blocks_out_of_order", (1, 2), (61, 40), 2, 1, 32, 4),
    AttentionCase("split_kv_decode", (1, 1, 1), (70, 5, 33), 4, 2, 64, 16, num_splits=4),
    AttentionCase("split_kv_mixed_gqa7", (1, 6), (50, 9), 7, 1, 32, 8, num_splits=3),
]
GPU_ATTENTION_CASES = [  # GPU-sized shapes with the kernel's own tile choices
    AttentionCase("gpu_decode_gqa4_long", tuple([1] * 8), tuple(range(1000, 9000, 1000)), 32, 8, 64, 16, block_n=None),
    AttentionCase("gpu_decode_split", tuple([1] * 4), (4000, 3000, 100, 7000), 32, 8, 128, 16, num_splits=8, block_n=None),
    AttentionCase("gpu_mixed_prefill", (300, 1, 1, 129, 1), (0, 500, 17, 64, 2000), 28, 4, 128, 16, block_n=None),
    AttentionCase("gpu_gqa3_padded80", (1, 64, 1), (900, 100, 33), 12, 4, 80, 32, block_n=None),
]


def make_attention_inputs(case: AttentionCase, dtype: torch.dtype, device, seed: int = 0, extra_blocks: int = 3):
    """Random query, caches and metadata; each row's blocks are a random permutation of the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(case.ctx_lens, case.q_lens, strict=True)]
    blocks_per_row = [math.ceil(s / case.block_size) for s in seq_lens]
    pool = sum(blocks_per_row) + extra_blocks  # spare blocks hold garbage that must never be read
    perm = torch.randperm(pool, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_row) + 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_row):
        block_tables[b, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    shape = (pool, case.block_size, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    query = torch.randn((sum(case.q_lens), case.num_heads, case.head_dim), generator=gen)
    qsl = [0]
    for q in case.q_lens:
        qsl.append(qsl[-1] + q)
    return dict(
        query=query.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
    )


def _upcast(inputs: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}


def attention_error(case: AttentionCase, dtype: torch.dtype, device, seed: int = 0) -> float:
    inputs = make_attention_inputs(case, dtype, device, seed)
    scale = case.head_dim**-0.5
    out = paged_attention(**inputs, scale=scale, num_splits=case.num_splits, block_n=case.block_n)
    ref = paged_attention_ref(**_upcast(inputs), scale=scale)
    return max_error(out, ref)


def kv_write_mismatches(dtype: torch.dtype, device, seed: int = 0, tokens_per_program: int | None = None) -> int:
    """Elements that differ from the reference after writing into a dirty cache (incl. -1 slots)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = 7, 4, 3, 40
    key = torch.randn((9, kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    value = torch.randn((9, kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    slots[[2, 6]] = -1  # padding tokens
    slots = slots.to(device)
    cache_k = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    kv_write(key, value, cache_k, cache_v, slots, tokens_per_program)
    kv_write_ref(key, value, ref_k, ref_v, slots)
    return int((cache_k != ref_k).sum().item() + (cache_v != ref_v).sum().item())


def rms_norm_error(dtype, device, hidden: int = 200, with_residual: bool = True, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((5, hidden), generator=gen).to(device=device, dtype=dtype)
    res = torch.randn((5, hidden), generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    if with_residual:
        out, new_res = rms_norm(x, w, 1e-6, residual=res)
        ref, ref_res = rms_norm_ref(x, w, 1e-6, residual=res)
        return max(max_error(out, ref), max_error(new_res, ref_res))
    return max_error(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def rotary_error(dtype, device, head_dim: int = 64, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, kv_heads = 6, 4, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    table = rope_cos_sin_cache(inv_freq, 128).to(device)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=gen).to(device=device, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, as after a QKV GEMM
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 7, 127, 64, 3], device=device)
    ref_q, ref_k = rotary_embedding_ref(positions, q.float(), k.float(), table)
    rotary_embedding(positions, q, k, table)
    return max(max_error(q, ref_q), max_error(k, ref_k))


def silu_mul_error(dtype, device, inter: int = 300, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((4, 2 * inter), generator=gen).to(device=device, dtype=dtype)
    return max_error(silu_mul(x), silu_mul_ref(x.float()))


def run_all(device, dtypes, cases=None) -> list[dict]:
    """Every check on `device` for each dtype; each result says its error, tolerance and verdict."""
    results = []

    def record(name, dtype, fn):
        tol = TOLERANCE[dtype]
        t0 = time.perf_counter()
        try:
            err = fn()
            results.append(dict(check=name, dtype=str(dtype).replace("torch.", ""), max_err=err, tol=tol,
                                ok=err <= tol, seconds=round(time.perf_counter() - t0, 3)))
        except Exception as exc:  # one broken check must not hide the others
            results.append(dict(check=name, dtype=str(dtype).replace("torch.", ""), max_err=None, tol=tol,
                                ok=False, error=f"{type(exc).__name__}: {exc}"))

    for dtype in dtypes:
        for case in cases if cases is not None else ATTENTION_CASES:
            record(f"paged_attention/{case.name}", dtype, lambda c=case, d=dtype: attention_error(c, d, device))
        record("kv_write", dtype, lambda d=dtype: float(kv_write_mismatches(d, device)))
        record("rms_norm", dtype, lambda d=dtype: rms_norm_error(d, device, with_residual=False))
        record("rms_norm_residual", dtype, lambda d=dtype: rms_norm_error(d, device))
        record("rotary", dtype, lambda d=dtype: rotary_error(d, device))
        record("silu_mul", dtype, lambda d=dtype: silu_mul_error(d, device))
    return results


def random_attention_cases(seed: int, count: int, max_len: int = 40) -> list[AttentionCase]:
    """Seeded random mixed batches: GQA 1/3/7, padded and power-of-two head dims, odd block sizes."""
    import random

    rng = random.Random(seed)
    cases = []
    for i in range(count):
        group = rng.choice([1, 3, 7])
        kv_heads = rng.choice([1, 2])
        rows = rng.randint(1, 4)
        q_lens = tuple(rng.choice([1, 1, rng.randint(1, 12)]) for _ in range(rows))
        ctx_lens = tuple(rng.choice([0, rng.randint(0, max_len)]) for _ in range(rows))
        cases.append(
            AttentionCase(
                name=f"random_{seed}_{i}", q_lens=q_lens, ctx_lens=ctx_lens,
                num_heads=group * kv_heads, num_kv_heads=kv_heads,
                head_dim=rng.choice([16, 24, 32, 40, 64]), block_size=rng.choice([1, 4, 8, 16]),
                num_splits=rng.choice([1, 1, 2, 3]),
            )
        )
    return cases
