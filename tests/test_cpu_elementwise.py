"""The CPU element-wise kernels give torch's bits: the add + RMSNorm (whose sum order is torch's,
found per hidden size), the rotary of q and k, the K/V write, and the rotary and K/V write in one
pass, at any row count and thread count."""

import pytest
import torch

from tokenmill.engine.layers import apply_rotary, rms_norm
from tokenmill.kernels.cpu import elementwise

pytestmark = pytest.mark.skipif(not elementwise.available(), reason="no C compiler")


def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("hidden", [64, 256, 576, 896, 1000, 4096, 16384])  # 16384: torch's cascade sum
@pytest.mark.parametrize("threads", [1, 2])
def test_add_rms_norm_is_torchs_bit_for_bit(hidden, threads):
    gen = torch.Generator().manual_seed(hidden)
    before = _threads(threads)
    try:
        for rows in (1, 3, 128, 300):
            wide = torch.randn(rows, hidden + 8, generator=gen) * 4
            x = wide[:, 8:]  # a row-strided view, as the layers' outputs can be
            res = torch.randn(rows, hidden, generator=gen)
            weight = torch.randn(hidden, generator=gen)
            normed, summed = elementwise.add_rms_norm(x, res, weight, 1e-5)
            assert torch.equal(summed, x + res)
            assert torch.equal(normed, rms_norm(x + res, weight, 1e-5)), rows
            alone, same = elementwise.add_rms_norm(x, None, weight, 1e-6)
            assert same is x and torch.equal(alone, rms_norm(x, weight, 1e-6))
    finally:
        torch.set_num_threads(before)


def test_the_sum_order_is_found_not_assumed():
    """The other lane count gives other bits on the probe's rows: the check at first use is what
    keeps a build whose vector width differs on the torch ops."""
    lib = elementwise.library()
    lanes = elementwise._lanes(lib, 576)
    assert lanes in (8, 16)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(256, 576, generator=gen) * torch.logspace(-3, 3, 256).unsqueeze(1)
    weight = torch.randn(576, generator=gen)
    want = rms_norm(x, weight, 1e-6)
    assert torch.equal(elementwise._call_norm(lib, x, None, weight, 1e-6, lanes)[0], want)
    other = 8 if lanes == 16 else 16
    assert not torch.equal(elementwise._call_norm(lib, x, None, weight, 1e-6, other)[0], want)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (9, 3, 64), (16, 8, 128), (2, 2, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rotary_is_torchs_bit_for_bit_on_the_fused_qkv_views(heads, kv_heads, head_dim, threads):
    gen = torch.Generator().manual_seed(heads * head_dim)
    before = _threads(threads)
    try:
        for rows in (1, 5, 128, 700):
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 10
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
            q, k = qk[:, :heads], qk[:, heads:]
            cos = torch.randn(rows, 1, head_dim // 2, generator=gen)
            sin = torch.randn(rows, 1, head_dim // 2, generator=gen)
            got_q, got_k = elementwise.rotary_qk(q, k, cos, sin)
            assert got_q.is_contiguous() and got_k.is_contiguous()
            assert torch.equal(got_q, apply_rotary(q, cos, sin)) and torch.equal(got_k, apply_rotary(k, cos, sin))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_heads, head_dim", [(2, 64), (3, 64), (1, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kv_write_puts_each_row_in_its_slot_as_index_copy_does(kv_heads, head_dim, threads):
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    before = _threads(threads)
    try:
        for rows in (1, 5, 256, 700):
            width = kv_heads * head_dim
            qkv = torch.randn(rows, 3 * width + 8, generator=gen)  # k and v: row-strided views, as in a layer
            k = qkv[:, width : 2 * width].view(rows, kv_heads, head_dim)
            v = qkv[:, 2 * width : 3 * width].view(rows, kv_heads, head_dim)
            shape = (64, 16, kv_heads, head_dim)
            key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            want_k, want_v = key_cache.clone(), value_cache.clone()
            slots = torch.randperm(64 * 16, generator=gen)[:rows]
            want_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
            want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
            assert elementwise.write_kv(k, v, key_cache, value_cache, slots)
            assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (9, 3, 64), (16, 8, 128), (2, 2, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rotary_and_kv_write_in_one_pass_are_the_two_calls_bit_for_bit(heads, kv_heads, head_dim, threads):
    """The fused pass gives rotary_qk's q and writes exactly what rotary_qk's k and write_kv would,
    to the same slots and nowhere else, from a row-strided fused projection."""
    gen = torch.Generator().manual_seed(heads * head_dim + 1)
    before = _threads(threads)
    try:
        for rows in (1, 5, 128, 700):
            width = (heads + 2 * kv_heads) * head_dim
            qkv = (torch.randn(rows, width + 8, generator=gen) * 10)[:, 8:]
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
            cos = torch.randn(rows, 1, head_dim // 2, generator=gen)
            sin = torch.randn(rows, 1, head_dim // 2, generator=gen)
            shape = (64, 16, kv_heads, head_dim)
            key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            want_k, want_v = key_cache.clone(), value_cache.clone()
            slots = torch.randperm(64 * 16, generator=gen)[:rows]
            want_q, rotated_k = elementwise.rotary_qk(qk[:, :heads], qk[:, heads:], cos, sin)
            assert elementwise.write_kv(rotated_k, v, want_k, want_v, slots)
            got_q = elementwise.rotary_write_kv(qkv, heads, kv_heads, cos, sin, key_cache, value_cache, slots)
            assert got_q is not None and got_q.is_contiguous() and got_q.shape == (rows, heads, head_dim)
            assert torch.equal(got_q, want_q), rows
            assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v), rows
    finally:
        torch.set_num_threads(before)


def test_the_fused_pass_refuses_what_it_cannot_take_and_writes_nothing():
    qkv, cos = torch.randn(4, 4 * 8), torch.randn(4, 1, 4)
    cache, slots = torch.zeros(2, 4, 1, 8), torch.arange(4)

    def fused(qkv=qkv, heads=2, kv_heads=1, cos=cos, cache=cache, slots=slots):
        return elementwise.rotary_write_kv(qkv, heads, kv_heads, cos, cos, cache, cache, slots)

    assert fused() is not None and cache.any()  # it applies to these shapes
    cache.zero_()
    assert fused(heads=3) is None  # q + k + v heads do not add up to the projection's width
    assert fused(kv_heads=2) is None  # the cache holds one kv head
    assert fused(qkv=qkv.t().contiguous().t()) is None  # columns strided
    assert fused(qkv=qkv.double(), cos=cos.double(), cache=cache.double()) is None
    assert fused(cache=cache.transpose(0, 1)) is None  # a strided cache
    assert fused(slots=slots.int()) is None
    assert fused(slots=slots[:3]) is None
    assert fused(cos=cos[:, :, :2]) is None
    assert not cache.any()  # nothing written by a refusal


def _counting(monkeypatch, name):
    """Calls of the kernel wrapper `name` that the C pass took (it returned a result)."""
    calls = []
    kernel = getattr(elementwise, name)

    def counted(*args, **kwargs):
        out = kernel(*args, **kwargs)
        calls.append(out is not None and out is not False)
        return out

    monkeypatch.setattr(elementwise, name, counted)
    return calls


def test_llama_outputs_are_the_same_with_the_fused_pass_off(tiny_llama_dir, monkeypatch):
    """Llama (no q/k norm) takes the fused rotary + K/V write in every layer: prefill rows, decode rows
    and the last layer's output rows give the same tokens and logprobs as the torch ops, which the
    engine's cpu_elementwise=off takes instead."""
    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    fused, norms = _counting(monkeypatch, "rotary_write_kv"), _counting(monkeypatch, "add_rms_norm")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (1, 17, 40, 90)]

    def run(setting):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02,
                                     cpu_elementwise=setting))
        res = engine.generate([EngineRequest(request_id=f"e{i}", prompt_token_ids=p,
                                             sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                                     logprobs=3))
                               for i, p in enumerate(prompts)])
        return [(list(res[f"e{i}"].output_token_ids), [lp.logprob for lp in res[f"e{i}"].output_logprobs])
                for i in range(len(prompts))]

    on = run("auto")
    assert fused and all(fused) and any(norms)  # the C passes ran (a norm of no rows is left to torch)
    fused.clear(), norms.clear()
    assert run("off") == on
    assert not fused and not norms  # the torch ops ran instead: the C passes were never asked


def test_what_the_kernels_do_not_take_is_left_to_torch():
    x, weight = torch.randn(4, 64), torch.randn(64)
    assert elementwise.add_rms_norm(x.bfloat16(), None, weight.bfloat16(), 1e-5) is None
    assert elementwise.add_rms_norm(x.t().contiguous().t(), None, weight, 1e-5) is None  # columns strided
    assert elementwise.add_rms_norm(x, torch.randn(4, 32), weight, 1e-5) is None
    q, cos = torch.randn(4, 2, 8), torch.randn(4, 1, 4)
    assert elementwise.rotary_qk(q, q.transpose(1, 2).contiguous().transpose(1, 2), cos, cos) is None
    assert elementwise.rotary_qk(q, q, cos[:, :, :2], cos[:, :, :2]) is None
    kv, cache, slots = torch.randn(4, 2, 8), torch.zeros(2, 4, 2, 8), torch.arange(4)
    assert not elementwise.write_kv(kv, kv, cache, cache, slots.int())  # int32 slots
    assert not elementwise.write_kv(kv, kv, cache.transpose(0, 1), cache, slots)  # a strided cache
    assert not elementwise.write_kv(kv.transpose(1, 2).contiguous().transpose(1, 2), kv, cache, cache, slots)
    assert not elementwise.write_kv(kv.double(), kv.double(), cache.double(), cache.double(), slots)
    assert not cache.any()  # nothing written by a refusal


def test_engine_outputs_are_the_same_with_the_kernels_off(tiny_qwen3_dir, monkeypatch):
    """Qwen3 also normalises q and k per head before the rotary: the whole layer path end to end."""
    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    rotary = _counting(monkeypatch, "rotary_qk")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (1, 17, 40, 90)]

    def run(setting):
        engine = Engine(EngineConfig(model=str(tiny_qwen3_dir), dtype="float32", kv_cache_gb=0.02,
                                     cpu_elementwise=setting))
        res = engine.generate([EngineRequest(request_id=f"e{i}", prompt_token_ids=p,
                                             sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                                     logprobs=3))
                               for i, p in enumerate(prompts)])
        return [(list(res[f"e{i}"].output_token_ids), [lp.logprob for lp in res[f"e{i}"].output_logprobs])
                for i in range(len(prompts))]

    on = run("auto")
    assert any(rotary)
    rotary.clear()
    assert run("off") == on and not rotary
