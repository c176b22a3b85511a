"""Load a Hugging Face checkpoint directory into our own model code.

A directory holds config.json (+ optional generation_config.json) and the weights as one
model.safetensors or shards listed by model.safetensors.index.json. Anything missing or unsupported is
one CheckpointError that names it; tensors are checked by name and shape before the model is used.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from tokenmill.engine import prepared_weights
from tokenmill.engine.attention import AttentionBackend
from tokenmill.engine.checkpoint_files import weight_files
from tokenmill.engine.model_config import CheckpointError, ModelConfig, load_model_config
from tokenmill.engine.models import MODEL_CLASSES
from tokenmill.kernels.cpu import gemm
from tokenmill.kernels.cpu.paths import CpuPaths

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes instead of loading.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _tensor_names(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    where[name] = path
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return where


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attention_backend: AttentionBackend,
    layer_ops: str = "auto",
    cpu_paths: CpuPaths | None = None,
) -> tuple[torch.nn.Module, ModelConfig]:
    """Build our model for the checkpoint at `path` and load its weights.

    dtype: "auto" (the checkpoint's dtype on CUDA, float32 elsewhere), "float32", "bfloat16", "float16".
    layer_ops: "auto" (fused Triton kernels for norm/rotary/SiLU on CUDA, torch elsewhere), "torch",
    "triton" (on a CPU only under the Triton interpreter, for tests).
    cpu_paths: the CPU kernels a float32 CPU model takes (default: every one that runs here).
    """
    model_dir = Path(path)
    device = torch.device(device)
    cfg = load_model_config(model_dir, dtype, device)
    files = weight_files(model_dir)
    where = _tensor_names(files)
    if "lm_head.weight" not in where and not cfg.tie_word_embeddings:
        # No separate output projection stored: the checkpoint ties it to the input embedding.
        cfg.tie_word_embeddings = True

    model = MODEL_CLASSES[cfg.architecture](cfg, attention_backend, device, layer_ops=layer_ops, cpu_paths=cpu_paths)
    needed = model.checkpoint_tensor_names()
    missing = [n for n in needed if n not in where]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir} lacks tensor(s) {shown}")
    wanted = set(needed)
    # A stored lm_head.weight of a tied checkpoint is a copy of the embedding (transformers ignores it too).
    unexpected = [n for n in where if n not in wanted and not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"]
    if unexpected:
        raise CheckpointError(
            f"{model_dir} holds tensor(s) a {cfg.architecture} model does not use: {', '.join(sorted(unexpected)[:5])}"
        )

    # On the CPU the model's own tensors (fused, packed) come from the file the first start kept
    # (prepared_weights.py), used in place; otherwise the checkpoint is copied in and packed.
    key = _prepared_key(model_dir, files, model) if device.type == "cpu" else None
    prepared = prepared_weights.load(model_dir, key) if key is not None else None
    if prepared is not None and not _adopt(model, prepared.parameters):
        log.warning("the prepared weights of %s do not fit the model: loading the checkpoint", model_dir)
        prepared = None
    if prepared is None:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                model.load_weights((n, f.get_tensor(n)) for n in f.keys() if n in wanted and where[n] == file)
    model.eval()
    # float32 on the CPU: the CPU paths' weights packed now (kernels/cpu/), or taken as prepared
    model.pack_for_cpu(prepared.packed if prepared is not None else None)
    if key is not None and prepared is None:
        prepared_weights.save(model_dir, key, dict(model.named_parameters()), model.onednn_packed())
    return model, cfg


def _prepared_key(model_dir: Path, files: list[Path], model: torch.nn.Module) -> dict:
    """The prepared-weights key of this model of this checkpoint: the choices that change what the model
    holds or packs (its architecture and flags, dtype, CPU paths, oneDNN's packing hint) with the files."""
    cfg = model.config
    layout = {"architecture": cfg.architecture, "tie_word_embeddings": cfg.tie_word_embeddings,
              "cpu_paths": dataclasses.asdict(model.cpu_paths), "pack_rows_hint": gemm.PACK_ROWS_HINT}
    return prepared_weights.entry_key(model_dir, files, cfg.dtype, layout)


def _adopt(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Point every parameter of the model at its prepared tensor (views into the prepared file), where
    the names, shapes and dtypes all match; False (nothing changed) where they do not."""
    params = dict(model.named_parameters())
    if set(params) != set(tensors) or any(
            tensors[n].shape != p.shape or tensors[n].dtype != p.dtype for n, p in params.items()):
        return False
    for name, param in params.items():
        param.data = tensors[name]
    return True
