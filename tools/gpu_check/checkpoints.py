"""Seeded random-weight Llama checkpoints of the sizes' shapes, built with tools/tiny_models.py."""

from __future__ import annotations

from pathlib import Path


def build_checkpoint(shape: dict, dtype_name: str, device, out_dir: Path) -> Path:
    """A Llama checkpoint of ``shape`` in ``out_dir`` (initialised on the device: fast even at 1B);
    a folder that already holds one is reused."""
    import torch

    from tokenmill.tools.tiny_models import build_tiny_model

    if (out_dir / "config.json").exists():
        return out_dir
    build_tiny_model(out_dir, arch="llama", seed=0, dtype=dtype_name, device=device, **shape)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_dir
