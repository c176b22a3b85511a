"""Attention through tokenmill's Triton kernels (kernels/): KV write by slot, paged attention.

Runs on CUDA; on a CPU only under the Triton interpreter (TRITON_INTERPRET=1), which is how the
test suite checks it. The same object serves every layer: it holds no per-layer state.
"""

from __future__ import annotations

import torch

from tokenmill.engine.attention.metadata import AttentionMetadata
from tokenmill.kernels.kv_write import kv_write
from tokenmill.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # None lets the kernel pick the KV split count per call from the GPU size; a fixed value
        # keeps launches identical across calls (needed while capturing a CUDA graph).
        self.num_splits = num_splits

    # The kernel's own signature: (key, value, key_cache, value_cache, slot_mapping).
    write_kv = staticmethod(kv_write)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_splits=self.num_splits,
        )
