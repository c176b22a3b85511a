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

    def __init__(self, num_splits: int | None = None, batch_invariant: bool = False) -> None:
        # None lets the kernel pick the KV split count per call from the GPU size; a fixed value
        # keeps launches identical across calls (needed while capturing a CUDA graph).
        # batch_invariant: keys cut at fixed multiples and one tile height, so a token's output never
        # depends on the rest of the launch (kernels/paged_attention.py); no split count is forced then.
        if batch_invariant and num_splits is not None:
            raise ValueError("a batch-invariant backend cuts keys at fixed multiples: num_splits cannot be forced")
        self.num_splits = num_splits
        self.batch_invariant = batch_invariant

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
            batch_invariant=self.batch_invariant,
        )
