"""GGUF file -> Hugging Face checkpoint directory (safetensors + config + tokenizer) that load_model reads.

The GGUF side is transformers' own GGUF support: AutoConfig / AutoTokenizer with `gguf_file=` read the
metadata and tokenizer, and `load_gguf_checkpoint` dequantizes every tensor and maps it to the
transformers parameter name (undoing llama.cpp's q/k row permutation). The model is only built on the
meta device to get that name mapping, so no quantizer state is ever attached to it, and the config
written out carries no `quantization_config`: the result is a plain float checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tokenmill.engine.model_config import CheckpointError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SERVABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # what tokenmill.engine.models implements
SHARD_BYTES = 4 * 1024**3


class ConvertError(CheckpointError):
    """A GGUF file cannot be converted; the message says why."""


def _check_gguf_file(gguf_file: Path) -> None:
    if not gguf_file.is_file():
        raise ConvertError(f"GGUF file {gguf_file} does not exist")
    with open(gguf_file, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConvertError(f"{gguf_file} is not a GGUF file (it does not start with the GGUF magic bytes)")


def _save_tensors(tensors: dict, out_dir: Path) -> None:
    """model.safetensors, or shards of at most SHARD_BYTES with the standard index file."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                 overwrite: bool = False) -> Path:
    """Write a safetensors checkpoint of `gguf_file` into `out_dir` (atomically: built beside it, renamed).

    dtype: dtype of the stored weights. float32 (default) keeps dequantized values exactly;
    bfloat16/float16 halve the size.
    """
    import torch

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    _check_gguf_file(gguf_file)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConvertError(f"unsupported dtype {dtype!r}; choose one of {', '.join(dtypes)}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConvertError(f"output directory {out_dir} exists and is not empty (pass overwrite to replace it)")
    try:
        import gguf  # noqa: F401  (transformers needs it for everything below)
    except ImportError as exc:
        raise ConvertError("reading GGUF needs the `gguf` package: pip install 'gguf>=0.17'") from exc
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    where, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise ConvertError(f"transformers cannot read {gguf_file}: {exc}") from exc
    if config.model_type not in SERVABLE_MODEL_TYPES:
        raise ConvertError(
            f"{gguf_file} holds a {config.model_type!r} model; tokenmill serves {', '.join(SERVABLE_MODEL_TYPES)}"
        )
    if hasattr(config, "quantization_config"):  # the weights are written dequantized
        del config.quantization_config
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name lands here; not a config field
        del config._model_name_or_path
    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        parsed["tensors"].pop("lm_head.weight", None)
    missing = sorted(expected - set(parsed["tensors"]))
    if missing:
        raise ConvertError(f"{gguf_file} lacks tensors for: {', '.join(missing[:5])}")
    tensors = {n: t.to(dtypes[dtype]).contiguous() for n, t in parsed["tensors"].items() if n in expected}
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        _save_tensors(tensors, tmp)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s (%d tensors, %s)", gguf_file, out_dir, len(tensors), dtype)
    return out_dir
