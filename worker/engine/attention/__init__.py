"""Attention behind one interface, so the model code never knows which backend runs.

Layout (shared with kernels/):
  query            [num_tokens, num_heads, head_dim]      tokens of all sequences of the step, packed
  key/value cache  [num_blocks, block_size, num_kv_heads, head_dim]  one pair per layer
  slot             block_id * block_size + offset_in_block

Row b of the batch owns query tokens query_start_loc[b] : query_start_loc[b+1]. Its context (tokens
already in the cache before this step) has length ctx_b = seq_lens[b] - query_len_b; query token i
sits at position ctx_b + i and attends causally to keys 0 .. ctx_b + i. A decode row has
query_len 1; a prefill or chunked-prefill row has many. Both mix in one call.
"""

from __future__ import annotations

import torch

from tokenmill.engine.attention.metadata import AttentionBackend, AttentionMetadata, OutputRows
from tokenmill.kernels.cpu.paths import CpuPaths

__all__ = ["AttentionBackend", "AttentionMetadata", "OutputRows", "BACKEND_NAMES", "get_attention_backend"]

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: str | torch.device = "cpu",
                          cpu_paths: CpuPaths | None = None) -> AttentionBackend:
    """A backend by name: "torch"; "triton"; "auto" = triton on CUDA, torch elsewhere. cpu_paths: the
    C kernels the torch backend takes on the CPU (default: every one that runs here)."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from tokenmill.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(cpu_paths)
    if name == "triton":
        try:
            from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"the triton attention backend is not available: {exc}") from exc
        return TritonAttentionBackend(batch_invariant=cpu_paths is not None and cpu_paths.batch_invariant)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
