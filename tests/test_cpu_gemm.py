"""CPU GEMMs on oneDNN's packed weight: close to F.linear, a row's bits independent of the row count
and the thread count (F.linear's are not), and only a few GEMM shapes ever built; the LM head always,
the layers' projections from hidden size 512; each way of the engine's onednn_linear and
onednn_layers settings."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.kernels.cpu import gemm
from tokenmill.kernels.cpu.paths import LAYERS_MIN_HIDDEN, CpuPaths, default_cpu_paths


def _paths(**chosen) -> CpuPaths:
    """This machine's paths with some chosen; the AMX GEMM and batch invariance off (a CPU with AMX puts
    every model's layers there, a batch-invariant engine on the fixed-order kernel, and this file tests
    oneDNN's and MKL's)."""
    return replace(default_cpu_paths(), amx_gemm=False, decode_layers_in_c=False, amx_prefill_attention=False,
                   batch_invariant=False, **chosen)


def _weights(out_features=96, in_features=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.1, torch.randn(out_features, generator=g)


def test_packed_linear_is_f_linear_within_rounding_with_and_without_bias():
    weight, bias = _weights()
    packed = gemm.pack(weight)
    x = torch.randn(37, 80, generator=torch.Generator().manual_seed(1))
    for b in (None, bias):
        got = gemm.linear(x, weight, b, packed)
        assert got.shape == (37, 96) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert gemm.linear(x[:0], weight, bias, packed).shape == (0, 96)
    wide = torch.randn(37, 160)
    torch.testing.assert_close(gemm.linear(wide[:, ::2], weight, None, packed), F.linear(wide[:, ::2], weight))


def test_a_row_gets_the_same_bits_at_any_row_count():
    weight, bias = _weights(640, 96)
    packed = gemm.pack(weight)
    x = torch.randn(600, 96, generator=torch.Generator().manual_seed(2))
    full = gemm.linear(x, weight, bias, packed)
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    for rows in (1, 2, 3, 7, 16, 33, 65, 100, 255, 256, 257, 300, 513):
        assert torch.equal(gemm.linear(x[:rows], weight, bias, packed), full[:rows]), rows
        assert torch.equal(gemm.linear(x[rows:rows + 5], weight, bias, packed), full[rows:rows + 5]), rows


def test_gemms_run_at_a_few_row_counts_with_little_padding():
    """oneDNN keeps ~0.65 MB of code per input shape it meets: a worker that met every row count
    would grow for hours. 32 row counts serve everything, padding at most 3 rows or an eighth."""
    sizes = {gemm._padded_rows(rows) for rows in range(1, gemm.MAX_ROWS + 1)}
    assert len(sizes) == 32 and max(sizes) == gemm.MAX_ROWS
    for rows in range(1, gemm.MAX_ROWS + 1):
        extra = gemm._padded_rows(rows) - rows
        assert 0 <= extra <= max(3, rows // 8), rows


def test_a_row_gets_the_same_bits_at_any_thread_count():
    weight, bias = _weights(1024, 128)
    packed = gemm.pack(weight)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(gemm.linear(x, weight, bias, packed))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_only_float32_cpu_weights_are_packed():
    weight, _ = _weights()
    assert gemm.pack(weight.to(torch.bfloat16)) is None
    assert gemm.pack(weight[0]) is None  # not a matrix
    x = torch.randn(3, 80)
    assert torch.equal(gemm.linear(x, weight, None, None), F.linear(x, weight))


def test_a_loaded_model_packs_its_lm_head_and_keeps_the_layers_on_f_linear(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend(), cpu_paths=_paths())
    assert model.config.hidden_size < LAYERS_MIN_HIDDEN
    assert all(layer._packed is None for layer in model.layers)
    cached = getattr(model, "_lm_head_oned", None)
    assert cached is not None and cached[1] is not None  # packed at load, not in the first step
    hidden = torch.randn(9, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head), atol=1e-5, rtol=1e-5)
    # A changed weight (a reload) is packed again, not served from the stale copy.
    with torch.no_grad():
        model.lm_head.mul_(2)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head), atol=1e-5, rtol=1e-5)


def test_turned_off_the_lm_head_is_f_linear_bit_for_bit(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend(),
                          cpu_paths=_paths(onednn_linear=False, greedy_screen=False))
    assert model._lm_head_packed() is None and getattr(model, "_lm_head_oned", None) is None  # never packed
    hidden = torch.randn(9, model.config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.lm_head))


def test_a_packed_weight_is_packed_again_after_an_in_place_write():
    weight, bias = _weights(64, 48)
    packed = gemm.PackedWeight(weight)
    x = torch.randn(5, 48)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    first = packed.packed()
    assert packed.packed() is first  # no repack while the weight is unchanged
    with torch.no_grad():
        weight.mul_(-3)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not gemm.available(), reason="torch without oneDNN")
def test_the_layers_choice_follows_the_hidden_size_and_the_setting():
    from tokenmill.engine import EngineConfig
    from tokenmill.kernels.cpu.paths import resolve_cpu_paths

    def layers(hidden, **settings):
        return resolve_cpu_paths(EngineConfig(model="m", amx_gemm="off", batch_invariant="off",
                                              **settings)).layer_gemm(hidden)

    assert layers(256) == "mkl" and layers(LAYERS_MIN_HIDDEN) == "onednn"
    assert layers(64, onednn_layers="on") == "onednn"
    assert layers(4096, onednn_layers="off") == "mkl"
    assert layers(4096, onednn_linear="off") == "mkl"  # oneDNN off altogether: MKL everywhere
    with pytest.raises(ValueError, match="onednn_layers=on, but this machine cannot take that path: it needs oneDNN"):
        layers(4096, onednn_layers="on", onednn_linear="off")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def wide_model_dir(request, tmp_path_factory):
    """hidden 512: the smallest width whose projections run on oneDNN (qwen2 adds q/k/v biases)."""
    from tokenmill.tools.tiny_models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp(f"wide-{request.param}"), request.param, seed=3, vocab_size=2048,
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    )


@pytest.mark.skipif(not gemm.available(), reason="torch without oneDNN")
def test_a_wide_model_runs_its_projections_on_onednn_and_keeps_transformers_greedy_path(wide_model_dir):
    from transformers import AutoModelForCausalLM

    from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    model, _ = load_model(wide_model_dir, attention_backend=TorchAttentionBackend(), cpu_paths=_paths())
    assert all(layer._packed is not None for layer in model.layers)
    layer = model.layers[0]
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer._linear(x, "qkv_weight", layer.qkv_bias),
                               F.linear(x, layer.qkv_weight, layer.qkv_bias), atol=1e-5, rtol=1e-5)

    unpacked, _ = load_model(wide_model_dir, attention_backend=TorchAttentionBackend(),
                             cpu_paths=_paths(onednn_layers=False))
    assert all(layer._packed is None for layer in unpacked.layers)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (1, 9, 17, 40)]
    hf = AutoModelForCausalLM.from_pretrained(str(wide_model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=12,
                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    # The engine's setting both ways (the AMX GEMM off: a CPU with AMX would take that kernel instead).
    for setting, packed in (("auto", True), ("off", False)):
        engine = Engine(EngineConfig(model=str(wide_model_dir), dtype="float32", kv_cache_gb=0.05, amx_gemm="off",
                                     batch_invariant="off", onednn_layers=setting))
        assert all((layer._packed is not None) == packed for layer in engine.runner.model.layers)
        res = engine.generate([EngineRequest(request_id=f"w{i}", prompt_token_ids=p,
                                             sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                               for i, p in enumerate(prompts)])
        assert [list(res[f"w{i}"].output_token_ids) for i in range(len(prompts))] == want, setting
