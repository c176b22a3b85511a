"""The attention interface's types: the step's metadata and the backend protocol (the layout is in
__init__.py). Below the backends, which import these, and the package, which picks a backend."""

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
