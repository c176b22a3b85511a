"""The AMX split-bfloat16 GEMM (kernels/cpu/amx_gemm.py): float32's accuracy against float64, a row's
bits independent of the row count, the other rows, the thread count and the K slabs, and the choice
of the layers' GEMM. The kernel tests need a CPU with AMX; the choice tests run anywhere."""

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import amx_gemm, gemm
from tokenmill.kernels.cpu.paths import LAYERS_MIN_HIDDEN, SETTINGS, CpuPaths, resolve_cpu_paths
from tokenmill.kernels.cpu.paths import default_cpu_paths as auto_paths

needs_amx = pytest.mark.skipif(not amx_gemm.available(), reason="this CPU has no AMX tiles (bf16)")


def _case(m, k, n, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    if spread:  # inputs of very different sizes, where a lost low part would show
        weight = weight * torch.logspace(-3, 3, k)
    return torch.randn(m, k, generator=g), weight, torch.randn(n, generator=g)


def _relative_error(got, x, weight, bias=None):
    want = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((got.double() - want).abs() / scale).max().item()


@needs_amx
@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (7, 40, 48), (37, 576, 960), (256, 1536, 576), (300, 688, 256)])
def test_products_are_as_accurate_as_float32_against_float64(m, k, n):
    x, weight, bias = _case(m, k, n)
    got = amx_gemm.SplitWeight(weight).linear(x, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    amx = _relative_error(got, x, weight, bias)
    onednn = _relative_error(F.linear(x, weight, bias), x, weight, bias)
    # The three parts keep float32's 24 bits: the error is float32 rounding, not bfloat16's 2^-9.
    assert amx < amx_gemm.SELF_CHECK_BOUND
    assert amx <= 2 * onednn + 1e-7


@needs_amx
def test_dropping_a_part_would_show():
    """The test above can fail: the same GEMM with the inputs rounded to one bfloat16 part is far off."""
    x, weight, _ = _case(64, 576, 96)
    coarse = F.linear(x.bfloat16().float(), weight.bfloat16().float())
    assert _relative_error(coarse, x, weight) > 100 * amx_gemm.SELF_CHECK_BOUND


@needs_amx
def test_a_row_gets_the_same_bits_at_any_row_count_and_beside_any_rows():
    x, weight, bias = _case(600, 1100, 70, seed=1)  # 1,100 inputs: several K slabs at 256 rows
    split = amx_gemm.SplitWeight(weight)
    full = split.linear(x, bias)
    for rows in (1, 2, 15, 31, 32, 33, 100, 255, 256, 257, 513):
        assert torch.equal(split.linear(x[:rows], bias), full[:rows]), rows
        assert torch.equal(split.linear(x[rows:rows + 5], bias), full[rows:rows + 5]), rows
    shuffled = torch.randperm(600, generator=torch.Generator().manual_seed(2))
    assert torch.equal(split.linear(x[shuffled], bias), full[shuffled])


@needs_amx
# Every way the threads share a call (amx_gemm.COLUMN_MAJOR_BLOCKS): column-major with each
# thread's own split (40 rows), column-major with the split shared (130 rows x a 3.5 MB weight),
# row-major (130 rows x a small weight; 300 and 1,100 rows: runs that start inside a row block, and
# several passes per thread at 1-3 threads).
@pytest.mark.parametrize(("rows", "n"), [(40, 1000), (130, 1000), (130, 200), (300, 1000), (1100, 300)])
def test_a_row_gets_the_same_bits_at_any_thread_count(rows, n):
    x, weight, bias = _case(rows, 576, n, seed=3)
    split = amx_gemm.SplitWeight(weight)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            results.append(split.linear(x, bias))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    assert _relative_error(results[0], x, weight, bias) < amx_gemm.SELF_CHECK_BOUND


@needs_amx
def test_strided_rows_and_no_rows():
    x, weight, _ = _case(40, 96, 64, seed=4)
    split = amx_gemm.SplitWeight(weight)
    wide = torch.zeros(40, 192)
    wide[:, ::2] = x
    assert torch.equal(split.linear(wide[:, ::2]), split.linear(x))  # a column-strided view is copied
    rows = torch.cat((x, x)).view(2, 40, 96)[:, :20].reshape(-1, 96)
    assert torch.equal(split.linear(rows), split.linear(rows.contiguous()))
    assert split.linear(x[:0]).shape == (0, 64)


@needs_amx
def test_a_packed_weight_is_split_again_after_an_in_place_write():
    x, weight, bias = _case(5, 48, 64, seed=5, spread=False)
    packed = gemm.PackedWeight(weight, "amx")
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    first = packed.packed()
    assert packed.packed() is first
    with torch.no_grad():
        weight.mul_(-3)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def _settings(**chosen):
    return SimpleNamespace(**{**dict.fromkeys(SETTINGS, "auto"), **chosen})


def test_the_setting_turns_it_off_and_a_cpu_without_amx_never_has_it(monkeypatch):
    assert not resolve_cpu_paths(_settings(amx_gemm="off")).amx_gemm
    assert resolve_cpu_paths(_settings(amx_gemm="auto")).amx_gemm == amx_gemm.available()
    monkeypatch.setattr(amx_gemm, "_ready", None)
    monkeypatch.setattr(amx_gemm, "_cpu_has_amx", lambda: False)
    assert not amx_gemm.available()
    with pytest.raises(ValueError, match="amx_gemm=on, but this machine cannot take that path: it needs a CPU with AMX"):
        resolve_cpu_paths(_settings(amx_gemm="on"))


@pytest.mark.parametrize("has_amx", [True, False])
def test_the_layers_choice(has_amx):
    onednn = "onednn" if gemm.available() else "mkl"
    paths = replace(auto_paths(), amx_gemm=has_amx, onednn_linear=gemm.available(), onednn_layers=None,
                    batch_invariant=False)
    # With AMX every size takes it; without, small models keep MKL (transformers' own bits).
    assert paths.layer_gemm(256) == ("amx" if has_amx else "mkl")
    assert paths.layer_gemm(LAYERS_MIN_HIDDEN) == ("amx" if has_amx else onednn)
    assert replace(paths, onednn_layers=False).layer_gemm(4096) == ("amx" if has_amx else "mkl")
    assert replace(paths, onednn_layers=False, amx_gemm=False).layer_gemm(4096) == "mkl"
    assert replace(paths, amx_gemm=False).layer_gemm(4096) == onednn
    assert replace(paths, amx_gemm=False).layer_gemm(256) == "mkl"
    assert CpuPaths().layer_gemm(4096) == "mkl"  # plain torch
    # A batch-invariant engine keeps the AMX kernel (a row's bits never depend on the batch there) and
    # otherwise takes the fixed-order kernel, whatever the size.
    assert replace(paths, batch_invariant=True).layer_gemm(256) == ("amx" if has_amx else "invariant")


@needs_amx
def test_a_wide_model_on_amx_keeps_transformers_greedy_path(tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams
    from tokenmill.tools.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "qwen2", seed=3, vocab_size=2048, hidden_size=512, intermediate_size=1024,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (1, 9, 17, 40, 300)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=12,
                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    for setting, kind in (("auto", "amx"), ("off", "onednn")):
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.05, amx_gemm=setting))
        layers = engine.runner.model.layers
        assert all(layer._packed is not None and layer._packed["qkv_weight"].kind == kind for layer in layers)
        res = engine.generate([EngineRequest(request_id=f"w{i}", prompt_token_ids=p,
                                             sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                               for i, p in enumerate(prompts)])
        assert [list(res[f"w{i}"].output_token_ids) for i in range(len(prompts))] == want, setting


@needs_amx
def test_silu_mul_folded_into_the_split_is_as_accurate_as_torchs():
    from tokenmill.engine.layers import silu_and_mul

    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(70, 2 * 200, generator=g) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])  # exp's edges
    weight = torch.randn(96, 200, generator=g) * 0.05
    split = amx_gemm.SplitWeight(weight)
    got = split.linear_silu_mul(gate_up)
    assert got.shape == (70, 96) and bool(got.isfinite().all())
    h64 = gate_up[:, :200].double() / (1 + torch.exp(-gate_up[:, :200].double())) * gate_up[:, 200:].double()
    want = h64 @ weight.double().T
    scale = h64.abs() @ weight.double().abs().T
    assert ((got.double() - want).abs() / scale).max().item() < amx_gemm.SELF_CHECK_BOUND
    # Through an identity weight the output is the folded input itself: within a few ulp of torch's
    # layer (its exp is another float32 implementation), and as close to float64 as torch's.
    eye = amx_gemm.SplitWeight(torch.eye(200))
    folded, torch_layer = eye.linear_silu_mul(gate_up), silu_and_mul(gate_up)
    torch.testing.assert_close(folded, torch_layer, rtol=5e-7, atol=1e-30)
    err = ((folded.double() - h64).abs() / h64.abs().clamp_min(1e-30)).max().item()
    torch_err = ((torch_layer.double() - h64).abs() / h64.abs().clamp_min(1e-30)).max().item()
    assert err < 2 * torch_err + 1e-7
    assert torch.equal(split.linear_silu_mul(gate_up[:9]), got[:9])  # rows independent here too


@needs_amx
def test_a_long_call_at_many_threads_stays_within_its_workspace():
    """More rows than a pass at 8 threads, on a thread whose workspace nothing grew before: each
    thread's run starts inside a row block and touches one more than an even share, and its slots
    must hold them all (a workspace sized for the even share would be written past)."""
    x, weight, bias = _case(300, 576, 1000, seed=4)
    split = amx_gemm.SplitWeight(weight)
    want = split.linear(x, bias)
    got = {}

    def run():
        torch.set_num_threads(8)
        got["y"] = split.linear(x, bias)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert torch.equal(got["y"], want)
