"""The vllm backend's settings, refusals and step watchdog, without vLLM: how EngineConfig becomes vLLM's
engine arguments, what the backend refuses to start with or to serve, and that a step that hangs or
an engine core that dies raises EngineDied instead of hanging. (Against real vLLM:
tests/test_vllm_backend.py and tests/test_vllm_worker.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import pytest

from tokenmill.cli import _apply_env_defaults
from tokenmill.cli.engine_options import add_engine_options, engine_kwargs
from tokenmill.engine.backends import EngineDied, create_engine
from tokenmill.engine.backends.vllm.requests import Capabilities, refusals
from tokenmill.engine.backends.vllm.settings import (
    ADAPTER_DEFAULTS,
    ADAPTER_SETTINGS,
    SAME_MEANING,
    TOKENMILL_ONLY,
    engine_args_kwargs,
    parse_vllm_args,
)
from tokenmill.engine.backends.vllm.watchdog import StepWatchdog
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.types import EngineRequest, SamplingParams

CAPS = Capabilities(whitespace="compact", priority_scheduling=True, max_logprobs=20)


def test_every_engine_setting_is_either_read_by_the_vllm_backend_or_refused_there():
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    tables = [set(SAME_MEANING), set(ADAPTER_SETTINGS), set(TOKENMILL_ONLY)]
    for name in names:
        assert sum(name in t for t in tables) == 1, name
    assert set().union(*tables) == set(names)


def test_vllm_args_are_key_value_items_with_json_values_where_they_parse():
    values, problems = parse_vllm_args(["tensor_parallel_size=2", "quantization=fp8", "enable-lora=true",
                                        'structured_outputs_config={"backend": "xgrammar"}', "x=", "bad"])
    assert values == {"tensor_parallel_size": 2, "quantization": "fp8", "enable_lora": True,
                      "structured_outputs_config": {"backend": "xgrammar"}, "x": ""}
    assert problems == ["--vllm-arg 'bad' is not KEY=VALUE (e.g. tensor_parallel_size=2)"]


def test_the_flag_repeats_and_its_variable_holds_several_split_like_shell_words(monkeypatch):
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    args = parser.parse_args(["--backend", "vllm", "--vllm-arg", "tensor_parallel_size=2", "--vllm-arg",
                              "kv_cache_dtype=fp8"])
    assert EngineConfig(model="m", **engine_kwargs(args)).vllm_args == ("tensor_parallel_size=2", "kv_cache_dtype=fp8")
    monkeypatch.setenv("TOKENMILL_BACKEND", "vllm")
    monkeypatch.setenv("TOKENMILL_VLLM_ARG", """max_loras=2 'hf_overrides={"a": 1}'""")
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    _apply_env_defaults(parser)
    config = EngineConfig(model="m", **engine_kwargs(parser.parse_args([])))
    assert (config.backend, config.vllm_args) == ("vllm", ("max_loras=2", 'hf_overrides={"a": 1}'))
    # Given on the command line, the flag replaces the variable's items.
    config = EngineConfig(model="m", **engine_kwargs(parser.parse_args(["--vllm-arg", "enable_lora=true"])))
    assert config.vllm_args == ("enable_lora=true",)


def test_the_vllm_backend_refuses_to_start_with_what_it_would_not_read():
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", backend="vllm", amx_gemm="off", structured_compile_threads=4, cuda_graphs="eager",
                     vllm_args=("max_num_seqs=8", "tokenizer=/x", "quantization=fp8", "quantization=awq", "oops"))
    message = str(info.value)
    for part in ("--amx-gemm, --structured-compile-threads: setting(s) of tokenmill's own engine",
                 "--cuda-graphs eager", "--vllm-arg max_num_seqs: set --max-num-seqs instead",
                 "--vllm-arg tokenizer: the vllm backend sets it itself", "--vllm-arg quantization is given twice",
                 "--vllm-arg 'oops' is not KEY=VALUE"):
        assert part in message
    with pytest.raises(ValueError, match="read by the vllm backend only"):
        EngineConfig(model="m", vllm_args=("quantization=fp8",))
    assert EngineConfig(model="m", backend="vllm", cpu_threads=2, vllm_args=("quantization=fp8",)).backend == "vllm"


def test_settings_become_vllm_engine_arguments_of_the_same_meaning(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), backend="vllm", kv_cache_gb=0.5, max_num_seqs=8, max_model_len=1024,
        cuda_graphs="off", served_model_name="m", enable_prefix_caching=False,
        vllm_args=("tensor_parallel_size=2", 'structured_outputs_config={"backend": "xgrammar"}'))
    kwargs = engine_args_kwargs(config, on_cpu=True, cpu_default_kv_gb=2.0)
    assert kwargs["dtype"] == "float32"  # tokenmill's auto on the CPU
    assert (kwargs["kv_cache_memory_bytes"], kwargs["max_num_seqs"], kwargs["max_model_len"]) == (2**29, 8, 1024)
    assert (kwargs["enforce_eager"], kwargs["served_model_name"], kwargs["enable_prefix_caching"]) == (True, "m", False)
    assert "block_size" not in kwargs and "async_scheduling" not in kwargs  # tokenmill's defaults: vLLM's own
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["scheduling_policy"] == "priority"
    # A dict for one of the adapter's defaults changes only the keys it names.
    assert kwargs["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert ADAPTER_DEFAULTS["structured_outputs_config"]["backend"] == "guidance"
    gpu = engine_args_kwargs(EngineConfig(model=str(tiny_llama_dir), backend="vllm"), on_cpu=False,
                             cpu_default_kv_gb=2.0)
    assert gpu["dtype"] == "auto" and "kv_cache_memory_bytes" not in gpu and "enforce_eager" not in gpu


def test_a_checkpoint_without_architectures_gets_one_for_vllm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    kwargs = engine_args_kwargs(EngineConfig(model=str(tmp_path), backend="vllm"), on_cpu=True, cpu_default_kv_gb=2.0)
    assert kwargs["hf_overrides"] == {"architectures": ["LlamaForCausalLM"]}


def _request(**sampling) -> EngineRequest:
    return EngineRequest("r", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(**sampling))


def test_a_request_is_refused_for_each_field_vllm_cannot_honour_with_the_field_and_backend_named():
    cases = {
        "sampling.temperature": _request(temperature=2.5),
        "sampling.n 2 with temperature 0": _request(n=2, temperature=0.0),
        "sampling.seed -1": _request(seed=-1),
        "sampling.structured_outputs.whitespace flexible": _request(
            structured_outputs={"json_object": True, "whitespace": "flexible"}),
    }
    for field_named, request in cases.items():
        (message,) = refusals(request, CAPS)
        assert message.startswith(field_named) and "the vllm backend" in message, message
    (message,) = refusals(_request(logprobs=5), dataclasses.replace(CAPS, max_logprobs=4))
    assert message.startswith("sampling.logprobs 5")
    (message,) = refusals(_request(prompt_logprobs=5, max_tokens=0), dataclasses.replace(CAPS, max_logprobs=4))
    assert message.startswith("sampling.prompt_logprobs 5")
    high = dataclasses.replace(_request(), priority=3)
    assert refusals(high, CAPS) == []
    (message,) = refusals(high, dataclasses.replace(CAPS, priority_scheduling=False))
    assert message.startswith("priority 3") and "the vllm backend" in message
    # Served: every other sampling field, and a whitespace mode that is the engine's own.
    served = _request(temperature=2.0, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.5,
                      frequency_penalty=-0.5, seed=7, stop=["x"], stop_token_ids=[2], ignore_eos=True, min_tokens=1,
                      max_tokens=9, logprobs=20, n=3, structured_outputs={"regex": "[ab]+", "whitespace": "flexible"})
    assert refusals(served, CAPS) == []


def test_the_default_backend_makes_tokenmills_own_engine(tiny_llama_dir):
    from tokenmill.engine.engine import Engine

    engine = create_engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01))
    assert type(engine) is Engine


def test_a_step_that_does_not_return_raises_engine_died_and_so_does_every_later_one():
    release = threading.Event()
    watchdog = StepWatchdog(timeout_s=0.3, poll_s=0.05, exit_grace_s=None)
    assert watchdog.run(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        watchdog.run(lambda: 1 / 0)  # a step's own error is the caller's, as it is
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="has not returned in"):
        watchdog.run(release.wait)
    assert 0.3 <= time.monotonic() - t0 < 5
    with pytest.raises(EngineDied):
        watchdog.run(lambda: 7)
    release.set()


def test_a_dead_engine_core_ends_a_step_that_waits_on_it():
    dead = threading.Event()
    release = threading.Event()
    watchdog = StepWatchdog(timeout_s=60, is_dead=dead.is_set, poll_s=0.05, exit_grace_s=None)
    threading.Timer(0.2, dead.set).start()
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="engine core died"):
        watchdog.run(release.wait)
    assert time.monotonic() - t0 < 5
    release.set()


def test_a_call_without_a_limit_may_take_longer_than_a_step():
    watchdog = StepWatchdog(timeout_s=0.05, poll_s=0.02, exit_grace_s=None)
    assert watchdog.run(lambda: time.sleep(0.3) or "built", limit_s=None) == "built"
