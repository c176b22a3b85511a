"""Our decoder against transformers' reference implementation (fp32, CPU) for Llama, Qwen2 and Qwen3:
whole prompts, chunked prefill and token-by-token decode through the paged cache (block tables out of
order), and a mixed batch of decode and prefill rows against each sequence alone."""

from dataclasses import replace

import pytest
import torch

from tests.paged_helpers import PagedKV, run_step
from tokenmill.engine.attention import AttentionMetadata, OutputRows
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.kernels.cpu.paths import CpuPaths, default_cpu_paths

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ours, cfg = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend())
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ours, cfg, ref


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def prompt(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()


def test_whole_prompt_matches_transformers(models):
    ours, cfg, ref = models
    ids = prompt(cfg, 45, seed=1)
    kv = PagedKV.for_model(cfg, num_blocks=16)
    (hidden,) = run_step(ours, kv, [("a", ids)])
    got = ours.compute_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (45, cfg.vocab_size)
    torch.testing.assert_close(got, reference_logits(ref, ids), atol=ATOL, rtol=0)


def test_chunks_then_token_by_token_match_transformers(models):
    ours, cfg, ref = models
    ids = prompt(cfg, 50, seed=2)
    expected = reference_logits(ref, ids)
    kv = PagedKV.for_model(cfg, num_blocks=16, block_size=4, seed=3)
    # Chunks that start and end inside blocks and across block boundaries, then single tokens.
    cuts = [0, 7, 8, 19, 33, 41] + list(range(42, 51))
    for a, b in zip(cuts, cuts[1:], strict=False):
        (hidden,) = run_step(ours, kv, [("a", ids[a:b])])
        torch.testing.assert_close(ours.compute_logits(hidden), expected[a:b], atol=ATOL, rtol=0)
    assert kv.tables["a"] != sorted(kv.tables["a"])  # the cache really was used out of order


def test_plain_torch_with_every_cpu_path_off_matches_transformers(models, tiny_model_dir):
    """The model on CpuPaths() (every CPU path setting off, as a CUDA engine hands it too) takes no C
    kernel and no oneDNN GEMM, and its logits still match transformers, chunk by chunk and token by
    token, as the default paths' do (the tests above)."""
    _, cfg, ref = models
    plain, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend(CpuPaths()), cpu_paths=CpuPaths())
    assert not plain.ops.c_elementwise and not plain.attention_backend.use_cpu_kernel
    assert plain._lm_head_packed() is None and plain.greedy_ids(torch.zeros(1, cfg.hidden_size)) is None
    ids = prompt(cfg, 40, seed=5)
    expected = reference_logits(ref, ids)
    kv = PagedKV.for_model(cfg, num_blocks=16, block_size=4, seed=3)
    cuts = [0, 9, 23, 33] + list(range(34, 41))
    for a, b in zip(cuts, cuts[1:], strict=False):
        (hidden,) = run_step(plain, kv, [("a", ids[a:b])])
        torch.testing.assert_close(plain.compute_logits(hidden), expected[a:b], atol=ATOL, rtol=0)


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["c-kernel", "torch"])
def test_mixed_batch_equals_each_sequence_alone(models, use_cpu_kernel):
    ours, cfg, ref = models
    ours.attention_backend = TorchAttentionBackend(replace(default_cpu_paths(), decode_attention=use_cpu_kernel))
    prompts = {name: prompt(cfg, n, seed=10 + i) for i, (name, n) in enumerate(
        [("d1", 21), ("d2", 9), ("d3", 40), ("fresh", 26), ("chunked", 30), ("one", 1)]
    )}
    expected = {name: reference_logits(ref, ids) for name, ids in prompts.items()}
    kv = PagedKV.for_model(cfg, num_blocks=64, block_size=8, seed=4)
    # Earlier steps: three sequences prefilled except their last token; the chunked one half done.
    run_step(ours, kv, [("d1", prompts["d1"][:-1]), ("d2", prompts["d2"][:-1]), ("chunked", prompts["chunked"][:13])])
    run_step(ours, kv, [("d3", prompts["d3"][:-1])])
    # The mixed step: decode rows, a fresh prefill, an extend-after-context row, a 1-token prompt.
    batch = [
        ("d1", prompts["d1"][-1:]),
        ("fresh", prompts["fresh"]),
        ("d2", prompts["d2"][-1:]),
        ("chunked", prompts["chunked"][13:]),
        ("d3", prompts["d3"][-1:]),
        ("one", prompts["one"]),
    ]
    rows = run_step(ours, kv, batch)
    ours.attention_backend = TorchAttentionBackend()
    for (name, new), hidden in zip(batch, rows, strict=True):
        want = expected[name][len(prompts[name]) - len(new):]
        torch.testing.assert_close(ours.compute_logits(hidden), want, atol=ATOL, rtol=0, msg=name)


def _output_rows(meta, batch, sampling):
    """OutputRows for the last token of each row named in `sampling` (as the model runner builds them)."""
    starts = meta.query_start_loc_cpu
    picked = [i for i, (name, _) in enumerate(batch) if name in sampling]
    lens = [meta.seq_lens_cpu[i] for i in picked]
    return OutputRows(
        index=torch.tensor([starts[i + 1] - 1 for i in picked], dtype=torch.long),
        meta=AttentionMetadata(
            query_start_loc=torch.arange(len(picked) + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=meta.block_tables[picked].contiguous(),
            slot_mapping=meta.slot_mapping[:0],
            max_query_len=1,
            max_seq_len=max(lens, default=0),
            query_start_loc_cpu=list(range(len(picked) + 1)),
            seq_lens_cpu=lens,
        ),
    )


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["c-kernel", "torch"])
def test_output_rows_skip_the_last_layer_for_other_tokens_only(models, use_cpu_kernel):
    """With OutputRows the last layer stops at its K/V write for every other token: the rows asked
    for equal the full forward's, and every layer's cache is bit for bit what the full forward wrote
    (later steps depend on it), also when no row samples."""
    ours, cfg, _ = models
    ours.attention_backend = TorchAttentionBackend(replace(default_cpu_paths(), decode_attention=use_cpu_kernel))
    prompts = {name: prompt(cfg, n, seed=40 + i) for i, (name, n) in enumerate(
        [("dec", 19), ("fresh", 23), ("chunk", 37), ("one", 1)]
    )}
    full_kv, trim_kv = (PagedKV.for_model(cfg, num_blocks=32, block_size=8, seed=6) for _ in range(2))
    steps = [
        # A prompt chunk that does not sample, alone: nothing is needed past the K/V write.
        ([("chunk", prompts["chunk"][:20])], set()),
        ([("dec", prompts["dec"][:-1]), ("chunk", prompts["chunk"][20:30])], {"dec"}),
        # Decode, a fresh prompt, a chunk that still does not sample, a one-token prompt.
        ([("dec", prompts["dec"][-1:]), ("fresh", prompts["fresh"]), ("chunk", prompts["chunk"][30:36]),
          ("one", prompts["one"])], {"dec", "fresh", "one"}),
    ]
    try:
        for batch, sampling in steps:
            ids, pos, meta = full_kv.step(batch)
            full = ours(ids, pos, meta, full_kv.kv_caches)
            ids, pos, meta = trim_kv.step(batch)
            rows = _output_rows(meta, batch, sampling)
            trimmed = ours(ids, pos, meta, trim_kv.kv_caches, rows)
            assert trimmed.shape == (len(sampling), cfg.hidden_size)
            torch.testing.assert_close(trimmed, full.index_select(0, rows.index), atol=1e-5, rtol=0)
            for (fk, fv), (tk, tv) in zip(full_kv.kv_caches, trim_kv.kv_caches, strict=True):
                assert torch.equal(fk, tk) and torch.equal(fv, tv)
    finally:
        ours.attention_backend = TorchAttentionBackend()


def test_lm_head_gives_each_row_the_same_bits_at_any_row_count(models):
    """On oneDNN's packed weight, or the fixed-order kernel of a batch-invariant engine (the default), a
    row's logits do not depend on what it is batched with (MKL's F.linear changes its summation order
    with the row count), and stay within rounding of F.linear."""
    ours, cfg, _ = models
    # This machine's torch has oneDNN and a C compiler: one of the two runs.
    assert ours._lm_head_packed() is not None or ours._lm_head_invariant() is not None
    hidden = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    full = ours.compute_logits(hidden)
    for rows in (1, 3, 4, 5, 15, 16, 17, 64):
        assert torch.equal(ours.compute_logits(hidden[:rows]), full[:rows]), rows
        assert torch.equal(ours.compute_logits(hidden[:rows], out=torch.empty(rows, cfg.vocab_size)), full[:rows]), rows
    torch.testing.assert_close(full, torch.nn.functional.linear(hidden, ours.lm_head), atol=1e-5, rtol=1e-5)


def test_lm_head_without_onednn_gives_the_bits_of_f_linear(tiny_model_dir):
    """Without oneDNN (the engine's onednn_linear off) the LM head multiplies by a transposed copy of
    the weight from 4 rows up; that copy must change no bit of any logit against F.linear."""
    paths = replace(default_cpu_paths(), onednn_linear=False, greedy_screen=False, batch_invariant=False)
    ours, cfg = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend(paths), cpu_paths=paths)
    assert ours._lm_head_packed() is None
    for rows in (1, 3, 4, 5, 15, 16, 17, 64):
        hidden = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
        want = torch.nn.functional.linear(hidden, ours.lm_head)
        assert torch.equal(ours.compute_logits(hidden), want), rows
        out = torch.empty(rows, cfg.vocab_size)
        assert torch.equal(ours.compute_logits(hidden, out=out), want), rows


def test_many_decode_rows_in_several_buckets_match(models):
    """Enough decode rows of spread lengths that the backend splits them into several buckets."""
    ours, cfg, ref = models
    lengths = [3 + 5 * i for i in range(40)]  # 3 .. 198 tokens
    prompts = {f"s{i}": prompt(cfg, n, seed=100 + i) for i, n in enumerate(lengths)}
    kv = PagedKV.for_model(cfg, num_blocks=2 * sum(lengths) // 8 + 64, block_size=8, seed=5)
    run_step(ours, kv, [(sid, ids[:-1]) for sid, ids in prompts.items()])
    batch = [(sid, ids[-1:]) for sid, ids in reversed(list(prompts.items()))]
    rows = run_step(ours, kv, batch)
    got = ours.compute_logits(torch.cat(rows))
    want = torch.stack([reference_logits(ref, prompts[sid])[-1] for sid, _ in batch])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_greedy_continuation_equals_transformers_generate(models):
    ours, cfg, ref = models
    ids = prompt(cfg, 12, seed=7)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 12:].tolist()
    kv = PagedKV.for_model(cfg, num_blocks=8, block_size=4, seed=8)
    new, tokens = ids, []
    for _ in range(8):
        (hidden,) = run_step(ours, kv, [("g", new)])
        token = int(ours.compute_logits(hidden[-1:]).argmax(-1))
        tokens.append(token)
        new = [token]
    assert tokens == out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_fp32(tiny_llama_dir, dtype):
    fp32, cfg32 = load_model(tiny_llama_dir, dtype="float32", attention_backend=TorchAttentionBackend())
    half, cfg = load_model(tiny_llama_dir, dtype=dtype, attention_backend=TorchAttentionBackend())
    assert cfg.dtype == dtype and half.embed_tokens.dtype == dtype
    ids = prompt(cfg32, 20, seed=9)
    a = fp32.compute_logits(run_step(fp32, PagedKV.for_model(cfg32), [("x", ids)])[0])
    b = half.compute_logits(run_step(half, PagedKV.for_model(cfg), [("x", ids)])[0])
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_fused_triton_layer_ops_match_transformers(models, tiny_model_dir):
    """The CUDA layer path (fused RMSNorm+residual, in-place rotary, SiLU-and-mul Triton kernels), run
    here under the Triton interpreter: same logits as transformers, prefill then decode."""
    _, cfg, ref = models
    fused, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend(), layer_ops="triton")
    assert fused.ops.name == "triton"
    ids = prompt(cfg, 11, seed=21)
    expected = reference_logits(ref, ids)
    kv = PagedKV.for_model(cfg, num_blocks=8, block_size=4, seed=22)
    (hidden,) = run_step(fused, kv, [("f", ids[:10])])
    torch.testing.assert_close(fused.compute_logits(hidden), expected[:10], atol=ATOL, rtol=0)
    (hidden,) = run_step(fused, kv, [("f", ids[10:])])
    torch.testing.assert_close(fused.compute_logits(hidden), expected[10:], atol=ATOL, rtol=0)


def test_unknown_layer_ops_is_an_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown layer ops 'fast'"):
        load_model(tiny_llama_dir, attention_backend=TorchAttentionBackend(), layer_ops="fast")


def test_llama3_rope_scaling_matches_transformers(tmp_path, tiny_llama_dir):
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "llama3-rope"
    shutil.copytree(tiny_llama_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    ours, cfg = load_model(ckpt, attention_backend=TorchAttentionBackend())
    plain, _ = load_model(tiny_llama_dir, attention_backend=TorchAttentionBackend())
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = prompt(cfg, 90, seed=31)
    got = ours.compute_logits(run_step(ours, PagedKV.for_model(cfg), [("r", ids)])[0])
    torch.testing.assert_close(got, reference_logits(ref, ids), atol=ATOL, rtol=0)
    default_rope = plain.compute_logits(run_step(plain, PagedKV.for_model(cfg), [("r", ids)])[0])
    assert (got - default_rope).abs().max() > 1e-3  # the scaling really changed the model
