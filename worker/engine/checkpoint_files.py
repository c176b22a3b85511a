"""What a checkpoint folder must hold, read without torch: a config.json that names an architecture
our model code implements, a tokenizer, and safetensors weights.

The commands check a ``--model`` folder with checkpoint_problems() before they import torch, so a
wrong folder fails in a fraction of a second instead of after the imports and the model load
(worker/cli/preflight.py). The model config, the loader and the tokenizer read the folder through
the same definitions, so the early check and the load never disagree on what a checkpoint is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: the message names what is missing or unsupported."""


CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files any of which lets AutoTokenizer build a tokenizer without the network.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# config.json model_type -> our architecture name, and the `architectures` class names that map to it.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def architecture(config: dict[str, Any]) -> str:
    """Our architecture name for a config.json's contents, or CheckpointError naming what it holds."""
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for cls in config.get("architectures") or []:
        if cls in ARCH_CLASSES:
            return ARCH_CLASSES[cls]
    shown = model_type or (config.get("architectures") or ["(none given)"])[0]
    raise CheckpointError(
        f"unsupported architecture {shown!r}; supported: {', '.join(sorted(ARCH_CLASSES))}"
    )


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked to exist."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise CheckpointError(f"{model_dir} lacks weight shard(s) listed in {INDEX_FILE}: {', '.join(missing)}")
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.gguf"))
    hint = f" (found {', '.join(others)}: only safetensors weights are loaded; convert GGUF with `tokenmill convert`)" if others else ""
    raise CheckpointError(f"{model_dir} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} with shards{hint}")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).exists() for name in TOKENIZER_FILES)


def no_tokenizer_message(model_dir: Path) -> str:
    return f"{model_dir} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"


def checkpoint_problems(model_dir: str | Path, *, weights: bool = True, ours: bool = True) -> list[str]:
    """Every reason the folder cannot be served, each naming the folder; [] when it looks whole.
    ``weights=False`` leaves the weights out (a command that needs only the tokenizer and config);
    ``ours=False`` is a checkpoint for another engine (vLLM): any architecture, and .bin weights too.

    Reads only file names and config.json: the weights' tensors and the tokenizer's contents are
    the loader's to check."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        return [f"model folder not found: {model_dir}" if not path.exists() else f"model {model_dir} is not a folder"]
    problems = []
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        problems.append(f"{path} has no {CONFIG_FILE}: not a checkpoint folder")
    else:
        try:
            config = read_json(config_path)
            if ours:
                architecture(config)
        except CheckpointError as exc:
            problems.append(f"{config_path}: {exc}")
        except OSError as exc:
            problems.append(f"cannot read {config_path}: {exc.strerror or exc}")
    if not has_tokenizer(path):
        problems.append(no_tokenizer_message(path))
    if weights and ours:
        try:
            weight_files(path)
        except CheckpointError as exc:
            problems.append(str(exc))
    elif weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(f"{path} has no weights: no *.safetensors or *.bin file")
    return problems
