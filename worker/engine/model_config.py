"""What the engine needs to know about a checkpoint, read from its config.json.

Only decoder-only architectures our own model code implements are accepted; anything else (an unknown
architecture, a feature like sliding-window attention we do not run) is a CheckpointError naming the
problem, never a model that silently computes something different from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# What a checkpoint folder holds is defined without torch (the CLI checks a folder before importing it).
from tokenmill.engine.checkpoint_files import CheckpointError, architecture, read_json

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class RopeConfig:
    """Rotary embedding parameters (Llama-3 style scaling when rope_type == "llama3")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int  # from max_position_embeddings
    eos_token_ids: list[int]  # from generation_config.json / config.json (list or int)
    dtype: torch.dtype
    # Details our model code needs beyond the agreed interface.
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama and Qwen3 when attention_bias
    o_bias: bool = False  # Llama and Qwen3 when attention_bias (Qwen2 never)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    rope: RopeConfig = field(default_factory=RopeConfig)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """"auto" = the checkpoint's dtype on CUDA, float32 elsewhere (CPU kernels are slow or inexact in 16 bits)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        cfg = (config_dtype or "float32").lower().removeprefix("torch.")
        return _DTYPE_NAMES.get(cfg, torch.float32)
    if name not in _DTYPE_NAMES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPE_NAMES[name]


def _as_id_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def read_eos_token_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    """EOS ids as generate() uses them: generation_config.json first, then config.json."""
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids = _as_id_list(read_json(gen_path).get("eos_token_id"))
        if ids is not None:
            return ids
    return _as_id_list(config.get("eos_token_id")) or []


def _rope_config(config: dict[str, Any], max_len: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs have rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    rope = RopeConfig(theta=float(theta), rope_type=rope_type)
    if rope_type == "llama3":
        try:
            rope.factor = float(merged["factor"])
            rope.low_freq_factor = float(merged["low_freq_factor"])
            rope.high_freq_factor = float(merged["high_freq_factor"])
            rope.original_max_position_embeddings = int(merged["original_max_position_embeddings"])
        except KeyError as exc:
            raise CheckpointError(f"llama3 rope scaling needs {exc.args[0]!r} in config.json") from exc
    return rope


def parse_model_config(model_dir: Path, config: dict[str, Any], dtype: torch.dtype) -> ModelConfig:
    arch = architecture(config)
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    absent = [k for k in required if config.get(k) is None]
    if absent:
        raise CheckpointError(f"config.json lacks {', '.join(absent)}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported hidden_act {act!r}; only silu is implemented")
    if config.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if config.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"only full_attention layers are supported, config has {sorted(set(layer_types))}")
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    max_len = int(config.get("max_position_embeddings") or 2048)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_model_len=max_len,
        eos_token_ids=read_eos_token_ids(model_dir, config),
        dtype=dtype,
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(config.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        rope=_rope_config(config, max_len),
    )


def load_model_config(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> ModelConfig:
    """Read config.json (+ generation_config.json) of a checkpoint directory."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{model_dir} has no config.json")
    config = read_json(config_path)
    cfg_dtype = config.get("dtype") or config.get("torch_dtype")
    return parse_model_config(model_dir, config, resolve_dtype(dtype, cfg_dtype, torch.device(device)))
