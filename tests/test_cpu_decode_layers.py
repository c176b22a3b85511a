"""A pure decode step's layers in one C call (kernels/cpu/decode_layers.py): the Python layers' bits,
only where it applies, off by its setting."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from tokenmill.engine.models.decoder import DecoderForCausalLM
from tokenmill.kernels.cpu import amx_gemm
from tokenmill.kernels.cpu.decode_layers import DecodeLayers

needs_amx = pytest.mark.skipif(not amx_gemm.available(), reason="this CPU has no AMX tiles (bf16)")


def _requests(vocab: int, n: int = 6, max_tokens: int = 6) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(11)
    return [EngineRequest(request_id=f"r{i}", prompt_token_ids=torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist(),
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i in range(n)]


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_each_decode_step_gives_the_python_layers_bits(tiny_llama_dir, tiny_qwen2_dir, threads, monkeypatch):
    """Every pure decode step of a Llama and a Qwen2 (q/k/v biases) model is run both ways: the same
    final hidden states and the same K/V written, bit for bit; prefill steps never take the driver."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    compared, driven = [], []
    original = DecoderForCausalLM.forward
    run = DecodeLayers.run

    def counting_run(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        driven.append(out is not None)
        return out

    def both_ways(self, input_ids, positions, meta, kv_caches, output_rows=None):
        with_driver = original(self, input_ids, positions, meta, kv_caches, output_rows)
        if output_rows is not None or self._decode_layers is None:
            return with_driver
        caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        driver, self._decode_layers = self._decode_layers, None
        try:
            python = original(self, input_ids, positions, meta, kv_caches, output_rows)
        finally:
            self._decode_layers = driver
        assert torch.equal(with_driver, python)
        assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(kv_caches, caches, strict=True))
        compared.append(input_ids.shape[0])
        return with_driver

    monkeypatch.setattr(DecoderForCausalLM, "forward", both_ways)
    monkeypatch.setattr(DecodeLayers, "run", counting_run)
    try:
        for model_dir in (tiny_llama_dir, tiny_qwen2_dir):
            engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.02))
            assert engine.runner.model._decode_layers is not None
            engine.generate(_requests(engine.model_config.vocab_size))
    finally:
        torch.set_num_threads(before)
    assert len(compared) >= 8 and all(driven)  # five decode steps per model, each taken by the driver


@needs_amx
def test_greedy_sequences_are_the_same_with_the_setting_off(tiny_llama_dir):
    on = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02))
    off = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02, decode_layers_in_c="off"))
    assert on.cpu_paths.decode_layers_in_c and not off.cpu_paths.decode_layers_in_c
    assert on.runner.model._decode_layers is not None and off.runner.model._decode_layers is None
    requests = _requests(on.model_config.vocab_size, n=8, max_tokens=12)
    got_on, got_off = on.generate(requests), off.generate(requests)
    assert [list(got_on[r.request_id].output_token_ids) for r in requests] == \
        [list(got_off[r.request_id].output_token_ids) for r in requests]


@needs_amx
def test_qk_norms_keep_the_python_layers(tiny_qwen3_dir):
    """Qwen3 normalises q and k per head before the rotary: no fused pass for it, so no driver."""
    engine = Engine(EngineConfig(model=str(tiny_qwen3_dir), dtype="float32", kv_cache_gb=0.02))
    assert engine.runner.model._decode_layers is None


def test_layers_off_the_amx_kernel_get_no_driver(tiny_llama_dir):
    """Without the AMX projections (turned off here; a CPU without AMX tiles alike) there is no
    driver, and decode steps run the Python layers; asked for all the same, the engine refuses to
    start and says what the path needs."""
    with pytest.raises(ValueError, match="decode_layers_in_c=on, but this machine cannot take that path: it needs "
                                         "amx_gemm, cpu_elementwise and cpu_attention_kernel all taken"):
        Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02, amx_gemm="off",
                            decode_layers_in_c="on"))
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02, amx_gemm="off"))
    assert not engine.cpu_paths.decode_layers_in_c and engine.runner.model._decode_layers is None
    res = engine.generate(_requests(engine.model_config.vocab_size, n=2))
    assert all(len(r.output_token_ids) == 6 for r in res.values())
