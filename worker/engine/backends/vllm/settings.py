"""How EngineConfig becomes vLLM's engine arguments, and what the vllm backend refuses to start with.

Torch-free and vLLM-free: EngineConfig checks a vllm config with ``config_problems`` before any
engine loads, so a flag that would mean nothing is refused with the other flag problems.

Every EngineConfig field is in exactly one of three tables (a test holds this):
- ``ADAPTER_SETTINGS``: read by the adapter itself (the backend, --vllm-arg, the CPU thread count);
- ``SAME_MEANING``: the tokenmill setting has a vLLM engine argument of the same meaning and goes
  over by name; ``--vllm-arg`` may not name that argument (one setting, one place).
- ``TOKENMILL_ONLY``: the setting steers tokenmill's own engine (its CPU kernels, its structured
  output compiler, its attention backends); left at its default it is ignored, set to anything
  else with ``--backend vllm`` it is refused, never silently dropped.

Everything vLLM has and tokenmill does not (tensor and pipeline parallelism, quantization, an FP8 KV
cache, LoRA, ...) goes through ``--vllm-arg KEY=VALUE``: VALUE is parsed as JSON where it parses
(``2``, ``true``, ``{"backend": "xgrammar"}``), else kept as a string (``fp8``); vLLM's own
``EngineArgs`` checks the lot at start. The adapter's own defaults (the structured outputs backend,
the scheduling policy) may be overridden there too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig

BACKEND = "vllm"

# EngineConfig field -> the vLLM engine argument it sets (the value is translated in engine_args_kwargs).
SAME_MEANING: dict[str, str] = {
    "model": "model",
    "dtype": "dtype",
    "block_size": "block_size",  # only when changed from tokenmill's default: else vLLM's own
    "kv_cache_gb": "kv_cache_memory_bytes",
    "gpu_memory_fraction": "gpu_memory_utilization",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "enable_prefix_caching": "enable_prefix_caching",
    "served_model_name": "served_model_name",
    "seed": "seed",
    "cuda_graphs": "enforce_eager",  # off -> eager; auto/on -> vLLM's compiled path and CUDA graphs
    "async_scheduling": "async_scheduling",
}
# Settings the adapter reads itself, outside vLLM's engine arguments.
ADAPTER_SETTINGS = ("backend", "vllm_args", "cpu_threads")
# Settings of tokenmill's own engine only: refused when set with --backend vllm.
TOKENMILL_ONLY = (
    "device", "attention_backend", "cpu_step_parts", "amx_gemm", "onednn_linear", "onednn_layers",
    "greedy_screen", "cpu_elementwise", "cpu_sampling", "cpu_attention_kernel", "decode_layers_in_c", "batch_invariant",
    "huge_pages", "malloc_tuning", "structured_compile_timeout_s", "structured_compile_threads",
)
# vLLM engine arguments the adapter must own: it encodes prompts with the model's tokenizer and reads
# vLLM's step statistics.
ADAPTER_OWNED = {
    "tokenizer": "prompts are encoded with the model folder's own tokenizer",
    "skip_tokenizer_init": "the adapter needs vLLM's detokenizer for text and stop strings",
    "disable_log_stats": "the adapter reads vLLM's step statistics (running, waiting, KV use)",
}
# The adapter's defaults for vLLM engine arguments tokenmill has no setting of (--vllm-arg overrides).
ADAPTER_DEFAULTS: dict[str, Any] = {
    # The guidance backend (llguidance, as tokenmill's own engine) with compact JSON: with vLLM's
    # default whitespace a small model can write whitespace until max_tokens (docs/vllm.md).
    "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
    # Job.priority orders waiting requests (lower first), as in tokenmill's own scheduler.
    "scheduling_policy": "priority",
}

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_GIB = 1024**3


def flag_of(config: EngineConfig, name: str) -> str:
    """The command-line flag of an EngineConfig field (as the CLI derives it). (The config is passed
    in, not imported: config.py calls this module.)"""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    return f.metadata["flag"] or "--" + name.replace("_", "-")


def _defaults(config: EngineConfig) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(config)}


def parse_vllm_args(items: tuple[str, ...] | list[str]) -> tuple[dict[str, Any], list[str]]:
    """({key: value}, problems) of --vllm-arg items. Dashes in a key become underscores (vLLM's own
    command line spells them with dashes); a value is JSON where it parses, else the string."""
    values: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not _KEY.fullmatch(key):
            problems.append(f"--vllm-arg {item!r} is not KEY=VALUE (e.g. tensor_parallel_size=2)")
            continue
        if key in values:
            problems.append(f"--vllm-arg {key} is given twice")
            continue
        try:
            values[key] = json.loads(raw)
        except ValueError:
            values[key] = raw
    return values, problems


def config_problems(config: EngineConfig) -> list[str]:
    """What the vllm backend cannot start with: malformed --vllm-arg items, an argument a tokenmill
    setting already sets or the adapter owns, and tokenmill-only settings changed from their default."""
    values, problems = parse_vllm_args(config.vllm_args)
    by_argument = {arg: name for name, arg in SAME_MEANING.items()}
    for key in values:
        if key in by_argument:
            problems.append(f"--vllm-arg {key}: set {flag_of(config, by_argument[key])} instead (the same setting)")
        elif key in ADAPTER_OWNED:
            problems.append(f"--vllm-arg {key}: the vllm backend sets it itself ({ADAPTER_OWNED[key]})")
    defaults = _defaults(config)
    changed = [name for name in TOKENMILL_ONLY if getattr(config, name) != defaults[name]]
    if changed:
        problems.append(
            f"{', '.join(flag_of(config, n) for n in changed)}: setting(s) of tokenmill's own engine, which the vllm "
            "backend does not read (vLLM's own engine arguments go through --vllm-arg)"
        )
    if config.cuda_graphs == "eager":
        problems.append("--cuda-graphs eager is tokenmill's own test path; the vllm backend takes auto, on or off")
    return problems


def engine_args_kwargs(config: EngineConfig, *, on_cpu: bool, cpu_default_kv_gb: float) -> dict[str, Any]:
    """EngineArgs keyword arguments for `config` (a vllm config without problems). `on_cpu`: vLLM
    runs on the CPU here, where tokenmill's default KV cache size applies when none is set."""
    defaults = _defaults(config)
    kwargs: dict[str, Any] = {
        "model": config.model,
        # tokenmill's "auto": float32 on the CPU (where vLLM's own auto would take bfloat16), the
        # checkpoint's dtype elsewhere (vLLM's auto: a float32 checkpoint then runs in 16 bits).
        "dtype": "float32" if config.dtype == "auto" and on_cpu else config.dtype,
        "gpu_memory_utilization": config.gpu_memory_fraction,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "enable_prefix_caching": config.enable_prefix_caching,
        "seed": config.seed,
        "disable_log_stats": False,
    }
    if config.block_size != defaults["block_size"]:
        kwargs["block_size"] = config.block_size
    kv_gb = config.kv_cache_gb if config.kv_cache_gb is not None else (cpu_default_kv_gb if on_cpu else None)
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * _GIB)
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.served_model_name is not None:
        kwargs["served_model_name"] = config.served_model_name
    if config.cuda_graphs != "auto":
        kwargs["enforce_eager"] = config.cuda_graphs == "off"
    if config.async_scheduling != "auto":
        kwargs["async_scheduling"] = config.async_scheduling == "on"
    overrides = architecture_override(config.model)
    values, _ = parse_vllm_args(config.vllm_args)
    merged = {**ADAPTER_DEFAULTS, **overrides, **kwargs}
    for key, value in values.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}  # e.g. structured_outputs_config: one key changed
        else:
            merged[key] = value
    return merged


def architecture_override(model_dir: str) -> dict[str, Any]:
    """{"hf_overrides": {"architectures": [...]}} for a checkpoint whose config.json names no
    architecture (tokenmill's GGUF conversions write only model_type), which vLLM needs to pick its
    model class; {} otherwise."""
    from pathlib import Path

    from tokenmill.engine.checkpoint_files import ARCH_CLASSES, CheckpointError, read_json

    try:
        config = read_json(Path(model_dir) / "config.json")
    except (OSError, CheckpointError):
        return {}  # vLLM says what is wrong with the folder
    if config.get("architectures"):
        return {}
    classes = {ours: cls for cls, ours in ARCH_CLASSES.items()}
    cls = classes.get(str(config.get("model_type")))
    return {"hf_overrides": {"architectures": [cls]}} if cls else {}
