"""The CPU LM head on oneDNN's packed weight: close to F.linear, a row's bits independent of the row
count and the thread count (F.linear's are not), and only a few GEMM shapes ever built."""

import torch
import torch.nn.functional as F

from worker.engine import cpu_gemm
from worker.engine.attention.torch_backend import TorchAttentionBackend
from worker.engine.loader import load_model


def _weights(out_features=96, in_features=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.1, torch.randn(out_features, generator=g)


def test_packed_linear_is_f_linear_within_rounding_with_and_without_bias():
    weight, bias = _weights()
    packed = cpu_gemm.pack(weight)
    x = torch.randn(37, 80, generator=torch.Generator().manual_seed(1))
    for b in (None, bias):
        got = cpu_gemm.linear(x, weight, b, packed)
        assert got.shape == (37, 96) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert cpu_gemm.linear(x[:0], weight, bias, packed).shape == (0, 96)
    wide = torch.randn(37, 160)
    torch.testing.assert_close(cpu_gemm.linear(wide[:, ::2], weight, None, packed), F.linear(wide[:, ::2], weight))


def test_a_row_gets_the_same_bits_at_any_row_count():
    weight, bias = _weights(640, 96)
    packed = cpu_gemm.pack(weight)
    x = torch.randn(600, 96, generator=torch.Generator().manual_seed(2))
    full = cpu_gemm.linear(x, weight, bias, packed)
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    for rows in (1, 2, 3, 7, 16, 33, 65, 100, 255, 256, 257, 300, 513):
        assert torch.equal(cpu_gemm.linear(x[:rows], weight, bias, packed), full[:rows]), rows
        assert torch.equal(cpu_gemm.linear(x[rows:rows + 5], weight, bias, packed), full[rows:rows + 5]), rows


def test_gemms_run_at_a_few_row_counts_with_little_padding():
    """oneDNN keeps ~0.65 MB of code per input shape it meets: a worker that met every row count
    would grow for hours. 32 row counts serve everything, padding at most 3 rows or an eighth."""
    sizes = {cpu_gemm._padded_rows(rows) for rows in range(1, cpu_gemm.MAX_ROWS + 1)}
    assert len(sizes) == 32 and max(sizes) == cpu_gemm.MAX_ROWS
    for rows in range(1, cpu_gemm.MAX_ROWS + 1):
        extra = cpu_gemm._padded_rows(rows) - rows
        assert 0 <= extra <= max(3, rows // 8), rows


def test_a_row_gets_the_same_bits_at_any_thread_count():
    weight, bias = _weights(1024, 128)
    packed = cpu_gemm.pack(weight)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(cpu_gemm.linear(x, weight, bias, packed))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_only_float32_cpu_weights_are_packed(monkeypatch):
    weight, _ = _weights()
    assert cpu_gemm.pack(weight.to(torch.bfloat16)) is None
    assert cpu_gemm.pack(weight[0]) is None  # not a matrix
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "0")
    assert not cpu_gemm.available() and cpu_gemm.pack(weight) is None
    x = torch.randn(3, 80)
    assert torch.equal(cpu_gemm.linear(x, weight, None, None), F.linear(x, weight))


def test_a_loaded_model_packs_its_lm_head_and_keeps_the_layers_on_f_linear(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend())
    cached = getattr(model, "_lm_head_oned", None)
    assert cached is not None and cached[1] is not None  # packed at load, not in the first step
    hidden = torch.randn(9, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head), atol=1e-5, rtol=1e-5)
    # A changed weight (a reload) is packed again, not served from the stale copy.
    with torch.no_grad():
        model.lm_head.mul_(2)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head), atol=1e-5, rtol=1e-5)


def test_switched_off_the_lm_head_is_f_linear_bit_for_bit(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "0")
    model, _ = load_model(tiny_model_dir, attention_backend=TorchAttentionBackend())
    hidden = torch.randn(9, model.config.hidden_size)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.lm_head))
