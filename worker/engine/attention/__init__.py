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

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [B]: context + new tokens, per row
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_row], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot each new token's K/V goes to
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU-side code needs no device sync to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass
class OutputRows:
    """The tokens of a step whose final hidden state is needed (the last token of each sampling
    sequence), and metadata that attends for them alone.

    Only these rows matter after the last layer has written its K/V, so that layer can run its
    attention, output projection and MLP for them only: for a prompt, 1 token instead of all of them.
    `meta` is decode-shaped: one query row per entry of `index`, with that sequence's full length.
    """

    index: torch.Tensor  # int64 [n]: rows of the step's packed tokens, in sampling order
    meta: AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: str | torch.device = "cpu") -> AttentionBackend:
    """A backend by name: "torch"; "triton"; "auto" = triton on CUDA, torch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from tokenmill.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        try:
            from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"the triton attention backend is not available: {exc}") from exc
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
