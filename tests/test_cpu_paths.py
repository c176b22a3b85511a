"""The one interface the engine asks which CPU path to take (kernels/cpu/paths.py): every path setting
is an EngineConfig setting, "auto" takes what runs here, "off" takes nothing (and probes nothing),
"on" refuses to start where a path cannot run, and the engine hands its resolved paths to the model
and the attention backend."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tokenmill.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from tokenmill.engine.config import CPU_PATH_CHOICES
from tokenmill.kernels.cpu import (
    amx_gemm,
    amx_prefill_attention,
    decode_attention,
    decode_layers,
    elementwise,
    gemm,
    greedy_screen,
    invariant_gemm,
    paths,
    row_logprobs,
    row_sample,
)
from tokenmill.kernels.cpu.paths import CpuPaths, default_cpu_paths, resolve_cpu_paths

PROBES = {  # each path's "can it run here" question
    "amx_gemm": (amx_gemm, "available"), "onednn_linear": (gemm, "available"),
    "greedy_screen": (greedy_screen, "available"), "cpu_elementwise": (elementwise, "available"),
    "cpu_attention_kernel": (decode_attention, "available"), "decode_layers_in_c": (decode_layers, "available"),
    "batch_invariant": (invariant_gemm, "available"), "cpu_sampling": (row_sample, "available"),
}


def _settings(**chosen) -> SimpleNamespace:
    return SimpleNamespace(**{**dict.fromkeys(paths.SETTINGS, "auto"), **chosen})


def test_every_path_setting_is_an_engine_setting_with_auto_on_off():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert paths.CHOICES == CPU_PATH_CHOICES
    for name in (*paths.SETTINGS, "huge_pages", "malloc_tuning"):
        assert fields[name].default == "auto" and fields[name].metadata["choices"] == CPU_PATH_CHOICES, name
        assert fields[name].metadata["help"].startswith("CPU"), name
    with pytest.raises(ValueError, match="amx_gemm must be one of auto, on, off, got '0'"):
        EngineConfig(model="m", amx_gemm="0")


def test_auto_takes_every_path_that_runs_here():
    got = default_cpu_paths()
    assert got == resolve_cpu_paths(EngineConfig(model="m"))  # the settings' defaults
    amx, attention, c_elementwise = amx_gemm.available(), decode_attention.available(), elementwise.available()
    invariant = attention and invariant_gemm.available()
    assert got == CpuPaths(
        amx_gemm=amx, onednn_linear=gemm.available(), onednn_layers=None,
        greedy_screen=gemm.available() and greedy_screen.available(), elementwise=c_elementwise,
        sampling=row_logprobs.available() and row_sample.available(),
        decode_attention=attention,
        amx_prefill_attention=amx and attention and not invariant and amx_prefill_attention.available(),
        decode_layers_in_c=amx and c_elementwise and attention and decode_layers.available(),
        batch_invariant=invariant,
    )
    # The machines this project tests on have a C compiler and torch with oneDNN.
    assert got.elementwise and got.sampling and got.decode_attention and got.onednn_linear and got.batch_invariant


def test_off_takes_no_path_and_builds_or_probes_nothing(monkeypatch):
    def no_probe():
        raise AssertionError("a path set off was probed")

    for module, name in PROBES.values():
        monkeypatch.setattr(module, name, no_probe)
    monkeypatch.setattr(amx_prefill_attention, "available", no_probe)
    off = resolve_cpu_paths(_settings(**dict.fromkeys(paths.SETTINGS, "off")))
    assert off == CpuPaths(onednn_layers=False)
    assert off.layer_gemm(4096) == "mkl"


@pytest.mark.parametrize("name", sorted(PROBES))
def test_on_where_a_path_cannot_run_refuses_to_start_and_says_what_it_needs(name, monkeypatch):
    module, probe = PROBES[name]
    monkeypatch.setattr(module, probe, lambda: False)  # this machine, as one without the path
    assert not getattr(resolve_cpu_paths(_settings(**{name: "auto"})), _field(name))
    with pytest.raises(ValueError, match=f"{name}=on, but this machine cannot take that path: it needs "):
        resolve_cpu_paths(_settings(**{name: "on"}))


def _field(setting: str) -> str:
    return {"cpu_elementwise": "elementwise", "cpu_sampling": "sampling",
            "cpu_attention_kernel": "decode_attention"}.get(setting, setting)


def test_a_path_set_on_that_runs_here_is_taken():
    for name in ("onednn_linear", "cpu_elementwise", "cpu_sampling", "cpu_attention_kernel"):  # what this project's machines have
        assert getattr(resolve_cpu_paths(_settings(**{name: "on"})), _field(name)), name


def test_paths_that_build_on_others_follow_them():
    # The screen needs the LM head on oneDNN; the decode layers in C need the AMX GEMM, the C
    # element-wise passes and the C attention; the AMX prefill needs the AMX GEMM and the C attention.
    assert not resolve_cpu_paths(_settings(onednn_linear="off")).greedy_screen
    with pytest.raises(ValueError, match="greedy_screen=on, but .* onednn_linear not off"):
        resolve_cpu_paths(_settings(onednn_linear="off", greedy_screen="on"))
    for name in ("amx_gemm", "cpu_elementwise", "cpu_attention_kernel"):
        assert not resolve_cpu_paths(_settings(**{name: "off"})).decode_layers_in_c, name
    assert not resolve_cpu_paths(_settings(amx_gemm="off")).amx_prefill_attention
    assert not resolve_cpu_paths(_settings(cpu_attention_kernel="off")).amx_prefill_attention


def test_the_engine_refuses_a_path_set_on_that_cannot_run_here(tiny_llama_dir):
    # Without AMX tiles (this project's test machines) amx_gemm=on stops the engine before it loads
    # anything; with them the engine takes the kernel, as asked.
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.01, amx_gemm="on")
    if amx_gemm.available():
        assert Engine(config).cpu_paths.amx_gemm
    else:
        with pytest.raises(ValueError, match="amx_gemm=on, but this machine cannot take that path"):
            Engine(config)


def test_the_engine_hands_its_paths_to_the_model_and_the_backend(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.01,
                                 cpu_attention_kernel="off", cpu_elementwise="off", onednn_linear="off"))
    model, backend = engine.runner.model, engine.attention_backend
    assert model.cpu_paths is engine.cpu_paths
    assert not backend.use_cpu_kernel and not backend.use_cpu_elementwise and not model.ops.c_elementwise
    assert model._lm_head_packed() is None
    default = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.01))
    assert default.cpu_paths == default_cpu_paths()
    assert default.attention_backend.use_cpu_kernel and default.runner.model.ops.c_elementwise


def test_the_c_attention_setting_both_ways_gives_the_same_greedy_tokens(tiny_llama_dir, monkeypatch):
    """cpu_attention_kernel: the C kernel runs (every decode row and short prompt goes through it) or
    never runs, and the greedy tokens are the same (each way matches transformers: test_engine_fidelity)."""
    calls = []
    kernel = decode_attention.paged_decode_attention
    monkeypatch.setattr(decode_attention, "paged_decode_attention",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (1, 9, 30, 70)]

    def run(setting: str) -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_gb=0.02,
                                     cpu_attention_kernel=setting))
        res = engine.generate([EngineRequest(request_id=f"a{i}", prompt_token_ids=p,
                                             sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
                               for i, p in enumerate(prompts)])
        return [list(res[f"a{i}"].output_token_ids) for i in range(len(prompts))]

    on = run("auto")
    assert calls
    calls.clear()
    assert run("off") == on and not calls
