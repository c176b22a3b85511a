"""A minimal paged KV cache for tests: hands out blocks in a shuffled order (so block tables are never
contiguous or sorted) and builds the AttentionMetadata of one step for a batch of sequences."""

from __future__ import annotations

import random

import torch

from tokenmill.engine.attention import AttentionMetadata


class PagedKV:
    def __init__(self, num_layers, num_kv_heads, head_dim, *, num_blocks=64, block_size=16,
                 dtype=torch.float32, seed=0):
        self.block_size = block_size
        self.kv_caches = [
            (torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype),
             torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype))
            for _ in range(num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    @classmethod
    def for_model(cls, cfg, **kw):
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, **kw)

    def step(self, batch: list[tuple[str, list[int]]]):
        """(input_ids, positions, meta) for appending each row's new tokens to its sequence."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for sid, new in batch:
            table = self.tables.setdefault(sid, [])
            start = self.lengths.get(sid, 0)
            end = start + len(new)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += new
            positions += range(start, end)
            starts.append(starts[-1] + len(new))
            seq_lens.append(end)
            self.lengths[sid] = end
        width = max(len(self.tables[sid]) for sid, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (sid, _) in enumerate(batch):
            tables[row, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta


def run_step(model, kv: PagedKV, batch):
    """Run one step; returns the hidden state per row, split by row: list of [q_len, hidden]."""
    input_ids, positions, meta = kv.step(batch)
    hidden = model(input_ids, positions, meta, kv.kv_caches)
    starts = meta.query_start_loc_cpu
    return [hidden[a:b] for a, b in zip(starts, starts[1:], strict=False)]
