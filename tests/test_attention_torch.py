"""The torch paged-attention backend against a direct per-token reference."""

import random
from dataclasses import replace

import pytest
import torch

from tokenmill.engine.attention import (
    AttentionMetadata,
    get_attention_backend,
    torch_backend,
)
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend, build_plan
from tokenmill.kernels.cpu import build, decode_attention
from tokenmill.kernels.cpu.paths import CpuPaths, default_cpu_paths

# Both decode paths: the C kernel (fp32 on CPU, built on first use) and plain torch.
PATHS = [pytest.param(True, id="c-kernel"), pytest.param(False, id="torch")]


def backend_with(use_cpu_kernel: bool) -> TorchAttentionBackend:
    """The backend with the C decode attention taken or not (the engine's cpu_attention_kernel)."""
    # Not batch invariant: these tests take each path (a batch-invariant backend sends every row to the kernel).
    return TorchAttentionBackend(replace(default_cpu_paths(), decode_attention=use_cpu_kernel, batch_invariant=False))


def test_cpu_kernel_builds_here():
    # The machines this project runs its tests on have a C compiler: the fast path must be active.
    assert decode_attention.available()
    assert TorchAttentionBackend().use_cpu_kernel
    # A backend handed paths without the kernel (a CUDA engine's, or the setting off) keeps torch.
    assert not TorchAttentionBackend(CpuPaths()).use_cpu_kernel
    assert get_attention_backend("torch", "cpu", CpuPaths()).use_cpu_kernel is False


def reference_attention(query, keys, values, rows, scale):
    """query [T, H, D]; keys/values per row [seq_len, Hkv, D]; rows = [(q_start, q_end, seq_len)]."""
    out = torch.empty_like(query, dtype=torch.float64)
    group = query.shape[1] // keys[0].shape[1]
    for (start, end, seq_len), k, v in zip(rows, keys, values, strict=True):
        context = seq_len - (end - start)
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        for i in range(end - start):
            visible = context + i + 1
            s = torch.einsum("hd,lhd->hl", query[start + i].double(), kk[:visible]) * scale
            out[start + i] = torch.einsum("hl,lhd->hd", s.softmax(-1), vv[:visible])
    return out


def random_case(seed, q_lens_and_ctx, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32):
    """Fill a cache with random K/V for each row's context + new tokens, blocks in shuffled order."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-(q + c) // block_size) for q, c in q_lens_and_ctx)
    num_blocks = blocks_needed + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    starts, seq_lens, tables, slots, keys, values, rows = [0], [], [], [], [], [], []
    new_keys, new_values = [], []
    for q_len, ctx in q_lens_and_ctx:
        seq_len = q_len + ctx
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        for pos in range(ctx):  # context is already in the cache
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len)]
        new_keys.append(k[ctx:])
        new_values.append(v[ctx:])
        keys.append(k)
        values.append(v)
        rows.append((starts[-1], starts[-1] + q_len, seq_len))
        starts.append(starts[-1] + q_len)
        seq_lens.append(seq_len)
        tables.append(table)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(q for q, _ in q_lens_and_ctx),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    query = torch.randn(starts[-1], num_heads, head_dim, generator=g).to(dtype)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, meta=meta, rows=rows,
                keys=keys, values=values, new_keys=torch.cat(new_keys), new_values=torch.cat(new_values))


def run_backend(case, scale, use_cpu_kernel=False):
    backend = backend_with(use_cpu_kernel)
    backend.write_kv(case["new_keys"], case["new_values"], case["key_cache"], case["value_cache"],
                     case["meta"].slot_mapping)
    return backend.attend(case["query"], case["key_cache"], case["value_cache"], case["meta"], scale)


CASES = [
    # (q_len, context) per row; heads, kv heads, head_dim, block size
    ([(1, 0)], 4, 4, 8, 4),  # a 1-token prompt
    ([(5, 0), (1, 7), (9, 4), (1, 15), (1, 16)], 4, 2, 16, 4),  # mixed, block boundaries
    ([(1, c) for c in range(0, 60, 3)], 6, 2, 8, 8),  # 20 decode rows -> several buckets
    ([(3, 0), (1, 30), (17, 13), (1, 2)], 7, 1, 24, 16),  # GQA group 7, head_dim not a power of 2
    ([(2, 5), (1, 8)], 3, 1, 32, 1),  # block size 1
    ([(4, 6), (1, 3), (4, 6), (4, 6), (7, 0), (1, 9), (7, 0)], 4, 2, 16, 4),  # prefill rows of equal shape
]


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
@pytest.mark.parametrize("rows,num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_matches_reference(rows, num_heads, num_kv_heads, head_dim, block_size, use_cpu_kernel):
    case = random_case(len(rows) * 7 + head_dim, rows, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = run_backend(case, scale, use_cpu_kernel)
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], scale)
    assert got.shape == case["query"].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_many_decode_rows_stay_exact(use_cpu_kernel):
    lens = [(1, c) for c in [0, 1, 2, 5, 9, 17, 33, 64, 100, 130, 131, 250] * 6] + [(7, 20), (12, 0)]
    random.Random(3).shuffle(lens)
    case = random_case(11, lens, 4, 2, 16, 8)
    plan = build_plan(case["meta"], 8, num_kv_heads=2, use_kernel=use_cpu_kernel)
    if use_cpu_kernel:  # the two short prefill rows' 7 + 12 tokens are kernel rows too
        assert plan.kernel_rows.token_index.numel() == len(lens) - 2 + 7 + 12 and not plan.decode
        assert not plan.prefill
    else:  # the torch path cuts decode rows into buckets of similar length
        assert len(plan.decode) >= 2 and plan.kernel_rows is None
        assert sum(b.token_index.numel() for b in plan.decode) == len(lens) - 2
        assert [g.num_rows for g in plan.prefill] == [1, 1]
    got = run_backend(case, 0.25, use_cpu_kernel)
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_only_kernel_plan_reads_the_table_in_place():
    """A pure decode step's kernel rows are the decode rows as they are (no pieces to join), the
    int32 table is the one given, not a copy, and max_len is the longest row; the step still attends
    exactly."""
    rows = [(1, c) for c in (3, 40, 1, 17, 9)]
    case = random_case(5, rows, 4, 2, 16, 4)
    table = case["meta"].block_tables
    assert table.dtype == torch.int32 and table.is_contiguous()
    plan = build_plan(case["meta"], 4, num_kv_heads=2, use_kernel=True)
    kr = plan.kernel_rows
    assert kr.block_tables.data_ptr() == table.data_ptr()
    assert kr.token_index.tolist() == [0, 1, 2, 3, 4] and kr.table_row.tolist() == [0, 1, 2, 3, 4]
    assert kr.seq_lens.tolist() == [4, 41, 2, 18, 10] and kr.seq_lens.dtype == torch.int32  # context + 1
    assert kr.max_len == 41
    got = run_backend(case, 0.25, True)
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_kernel_takes_short_prefill_rows_token_by_token_and_leaves_long_ones_to_sdpa(monkeypatch):
    """With the kernel, a prefill row up to KERNEL_PREFILL_MAX_LEN tokens (context included) becomes
    one kernel row per token, each seeing the keys up to its position; a longer row keeps SDPA. Both
    kinds, with and without cached context, in one step, against the float64 reference."""
    monkeypatch.setattr(torch_backend, "KERNEL_PREFILL_MAX_LEN", 24)
    rows = [(9, 0), (1, 30), (5, 19), (30, 0), (6, 20), (1, 3), (24, 0)]  # lengths 9 20 24 stay short
    case = random_case(31, rows, 6, 2, 16, 4)
    plan = build_plan(case["meta"], 4, num_kv_heads=2, use_kernel=True)
    assert sorted((g.q_len, g.seq_len) for g in plan.prefill) == [(6, 26), (30, 30)]
    kr = plan.kernel_rows
    assert kr.token_index.numel() == 2 + 9 + 5 + 24
    starts = case["meta"].query_start_loc_cpu
    lengths = {int(t): int(n) for t, n in zip(kr.token_index, kr.seq_lens, strict=True)}
    assert [lengths[starts[2] + i] for i in range(5)] == [20, 21, 22, 23, 24]  # context 19, then causal
    assert [lengths[starts[0] + i] for i in range(9)] == list(range(1, 10))
    assert kr.max_len == 31
    got = run_backend(case, 0.25, True)
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_rows_of_one_shape_attend_as_one_group():
    rows = [(4, 6), (1, 3), (4, 6), (4, 6), (7, 0), (1, 9), (7, 0)]
    case = random_case(21, rows, 4, 2, 16, 4)
    plan = build_plan(case["meta"], 4, num_kv_heads=2)
    shapes = sorted((g.num_rows, g.q_len, g.seq_len) for g in plan.prefill)
    assert shapes == [(2, 7, 7), (3, 4, 10)]


def test_kernel_and_torch_paths_agree_on_long_contexts():
    case = random_case(8, [(1, 700), (1, 1023), (3, 500), (1, 64)], 9, 3, 64, 16)
    a = run_backend(case, 0.125, use_cpu_kernel=True)
    b = run_backend(case, 0.125, use_cpu_kernel=False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kernel_gives_identical_results_on_several_threads():
    lens = [(1, c) for c in range(0, 900, 37)]
    case = random_case(12, lens, 4, 2, 16, 8)
    meta, kc, vc = case["meta"], case["key_cache"], case["value_cache"]
    backend_with(True).write_kv(case["new_keys"], case["new_values"], kc, vc, meta.slot_mapping)
    outs = []
    for threads in (1, 3):
        out = torch.zeros_like(case["query"])
        decode_attention.paged_decode_attention(
            case["query"], kc, vc, meta.block_tables.contiguous(), torch.tensor(meta.query_start_loc_cpu[:-1]),
            torch.arange(len(lens)), meta.seq_lens, meta.max_seq_len, out, 0.25, num_threads=threads,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # rows are independent: threading changes nothing
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], 0.25)
    torch.testing.assert_close(outs[1].double(), want, atol=1e-5, rtol=1e-5)


def test_fp16_close_to_reference():
    case = random_case(5, [(4, 3), (1, 20), (1, 6)], 4, 2, 16, 4, dtype=torch.float16)
    got = run_backend(case, 0.25)
    want = reference_attention(case["query"], case["keys"], case["values"], case["rows"], 0.25)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)


def test_write_kv_puts_each_token_at_its_slot():
    backend = TorchAttentionBackend()
    kc = torch.zeros(4, 2, 1, 3)
    vc = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    backend.write_kv(key, -key, kc, vc, torch.tensor([7, 0, 3]))
    assert torch.equal(kc[3, 1, 0], key[0, 0]) and torch.equal(kc[0, 0, 0], key[1, 0])
    assert torch.equal(kc[1, 1, 0], key[2, 0]) and torch.equal(vc[1, 1, 0], -key[2, 0])
    assert kc.abs().sum() == key.sum()  # nothing else written


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_plan_is_rebuilt_when_block_table_changes_in_place(use_cpu_kernel):
    case = random_case(2, [(1, 9), (1, 3)], 2, 2, 8, 4)
    backend = backend_with(use_cpu_kernel)
    meta = case["meta"]
    backend.write_kv(case["new_keys"], case["new_values"], case["key_cache"], case["value_cache"], meta.slot_mapping)
    first = backend.attend(case["query"], case["key_cache"], case["value_cache"], meta, 0.3)
    # Move row 1's only block to a spare block and update the table in place.
    old = int(meta.block_tables[1, 0])
    spare = next(b for b in range(case["key_cache"].shape[0]) if b not in meta.block_tables.flatten().tolist())
    case["key_cache"][spare] = case["key_cache"][old]
    case["value_cache"][spare] = case["value_cache"][old]
    case["key_cache"][old] = 1e3
    meta.block_tables[1, 0] = spare
    second = backend.attend(case["query"], case["key_cache"], case["value_cache"], meta, 0.3)
    torch.testing.assert_close(second, first)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_bad_metadata_is_a_clear_error(use_cpu_kernel):
    case = random_case(4, [(1, 30)], 2, 2, 8, 4)
    meta = case["meta"]
    backend = backend_with(use_cpu_kernel)
    tables = meta.block_tables
    meta.block_tables = tables[:, :3]  # the row needs 8 blocks
    with pytest.raises(ValueError, match="needs 8 blocks"):
        backend.attend(case["query"], case["key_cache"], case["value_cache"], meta, 1.0)
    meta.block_tables = tables.clone()
    meta.block_tables[0, 2] = case["key_cache"].shape[0]  # one past the last block: would read out of bounds
    with pytest.raises(ValueError, match="block_tables hold ids outside"):
        backend.attend(case["query"], case["key_cache"], case["value_cache"], meta, 1.0)


@pytest.mark.parametrize("use_cpu_kernel", PATHS)
def test_the_first_bad_row_is_named(use_cpu_kernel):
    case = random_case(4, [(1, 9), (2, 5), (1, 30)], 2, 2, 8, 4)
    meta = case["meta"]
    meta.block_tables = meta.block_tables[:, :3]  # row 2 needs 8 blocks
    meta.seq_lens_cpu = [9, 1, 30]  # row 1: 2 query tokens for a sequence of 1
    with pytest.raises(ValueError, match="row 1: 2 query tokens for a sequence of length 1"):
        build_plan(meta, 4, num_kv_heads=2, use_kernel=use_cpu_kernel)
    meta.seq_lens_cpu = [9, 5, 30]
    with pytest.raises(ValueError, match="row 2: length 30 needs 8 blocks, block table has 3"):
        build_plan(meta, 4, num_kv_heads=2, use_kernel=use_cpu_kernel)


def test_factory():
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def _libgomp_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line}


@pytest.mark.skipif(not decode_attention.available(), reason="no C compiler")
def test_the_kernel_runs_on_torchs_openmp_runtime_not_a_second_one():
    lib = decode_attention.load()
    assert lib is not None
    assert _imports(lib._name, "GOMP_parallel")  # built with OpenMP
    # One libgomp in the process (torch's): the kernel's threads are the ones torch's GEMMs use.
    assert len(_libgomp_files()) == 1, _libgomp_files()


def _imports(path: str, symbol: str) -> bool:
    import subprocess

    out = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True, check=True)
    return any(line.split()[-1].startswith(symbol) for line in out.stdout.splitlines())


@pytest.mark.skipif(not decode_attention.available(), reason="no C compiler")
def test_without_openmp_the_pthread_build_is_used(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(build, "OPENMP_FLAGS", ["-fno-such-flag-for-this-test"])
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    fresh = build.OnDemandLibrary("decode_attention.c", "test build", decode_attention._declare)
    lib = fresh.get()
    assert lib is not None and str(tmp_path) in lib._name
    out = subprocess.run(["nm", "-D", "--undefined-only", lib._name], capture_output=True, text=True, check=True)
    names = {line.split()[-1].split("@")[0] for line in out.stdout.splitlines()}
    assert "pthread_create" in names and "GOMP_parallel" not in names
