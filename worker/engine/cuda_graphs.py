"""CUDA-graph replay of decode steps, padded up to a captured batch size.

A decode step of a small model is dozens of kernel launches per layer; at batch sizes where the GPU
finishes each in microseconds, launching them from Python costs more than running them. Capturing
the whole step (forward + LM head) once per batch size and replaying it removes that cost.

How it works:
- Static input buffers (token ids, positions, seq_lens, block tables, slot mapping) are allocated
  once for the largest size; each captured size uses leading slices of them, so a graph always
  reads the same addresses. query_start_loc of a decode batch is always 0..B and never changes.
- A batch of n decode rows runs in the smallest captured size B >= n. The B - n padding rows carry
  token 0 at position 0, seq_len 1, block table row 0 and slot -1: they attend to one key (any
  finite value), write nothing to the KV cache (the KV-write kernel skips negative slots) and their
  logits are dropped.
- Attention must read only device tensors of the metadata (the Triton backend does; the torch
  backend reads the host lists, which a graph cannot see change). The metadata's host hints are
  fixed at capture: max_query_len 1 and max_seq_len = the longest sequence the block table allows,
  so the KV split count is chosen once per size and each split's share of the keys is computed on
  the GPU from the real sequence lengths at replay.
- All sizes share one memory pool and are captured largest first, so smaller graphs reuse the
  larger ones' activation memory; every graph copies its logits into one shared output buffer.
  The returned logits are a view of that buffer: consume them before the next replay.

With use_graphs=False the same padded path runs eagerly on the static buffers: that is how it is
tested on a CPU (there is no graph capture without CUDA).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from tokenmill.engine.attention import AttentionMetadata

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture for an engine running at most max_num_seqs sequences per step: the
    default sizes below it, then max_num_seqs itself (so every decode batch has a graph)."""
    return sorted({b for b in DEFAULT_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})


def graph_memory_bytes(max_batch: int, vocab_size: int, hidden_size: int, intermediate_size: int, dtype_bytes: int) -> int:
    """A generous estimate of the GPU memory captured decode graphs hold: the shared logits output
    [max_batch, vocab] fp32, the largest graph's own logits (model dtype and fp32), its activations
    (a few hidden- and intermediate-sized tensors per row, reused across layers by the pool) and a
    fixed margin for kernel workspaces. Not measured on a GPU yet: it keeps the KV cache from
    taking the memory the graphs need, at the price of a little KV space."""
    logits = max_batch * vocab_size * (4 + 4 + dtype_bytes)
    activations = max_batch * (8 * hidden_size + 3 * intermediate_size) * dtype_bytes
    return logits + activations + 64 * 1024**2


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_blocks_per_seq: int,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        use_graphs: bool | None = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {list(batch_sizes)}")
        if getattr(getattr(model, "attention_backend", None), "name", "triton") != "triton":
            raise ValueError("decode graphs need an attention backend that reads only device tensors (triton)")
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        self.block_size = kv_caches[0][0].shape[1]
        self.batch_sizes = sorted(set(batch_sizes))
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        max_b = self.batch_sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_b, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((max_b,), -1, dtype=torch.long, device=dev)
        self.max_seq_len = max_blocks_per_seq * self.block_size
        self._metas = {b: self._meta(b) for b in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits_out: torch.Tensor | None = None  # [largest size, vocab] float32, written by replays

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            # Host copies are not kept current in graph mode; a graph-safe backend never reads them.
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
        )

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._metas[b], self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size (CUDA only). Padding state makes every warm-up harmless."""
        if not self.use_graphs:
            return
        self._reset_padding(0, self.batch_sizes[-1])
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            warm = self._forward(b)  # compile the Triton kernels and settle the allocator outside capture
            if self._logits_out is None:
                # One output buffer for every size: each graph copies its logits into a slice, so the
                # graphs' own logits tensors are freed after capture and their memory is shared.
                self._logits_out = torch.empty((b, warm.shape[1]), dtype=warm.dtype, device=self.device)
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits_out[:b].copy_(self._forward(b))
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs decode rows runs in, or None if it is too big."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A pure decode step (one token per row) that fits a captured size."""
        return (
            meta.max_query_len == 1
            and meta.num_tokens == meta.num_seqs
            and self.padded_size(meta.num_seqs) is not None
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def _reset_padding(self, start: int, stop: int) -> None:
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.seq_lens[start:stop].fill_(1)
        self.block_tables[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """float32 logits [num_seqs, vocab] of a decode step; every row samples."""
        if not self.can_run(meta):
            raise ValueError(
                f"not a decode batch this runner can take: {meta.num_seqs} rows, {meta.num_tokens} tokens, "
                f"max_query_len {meta.max_query_len}, captured sizes up to {self.batch_sizes[-1]}"
            )
        n = meta.num_seqs
        b = self.padded_size(n)
        width = meta.block_tables.shape[1]
        # Device-to-device copies only: nothing here waits for the GPU.
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # Columns past `width` may hold an older batch's blocks: the kernel reads only the blocks
        # that seq_len covers, all of which lie within `width`.
        self._reset_padding(n, b)
        if self.use_graphs:
            if b not in self._graphs:
                raise RuntimeError("capture() must run before run() in graph mode")
            self._graphs[b].replay()
            return self._logits_out[:n]
        return self._forward(b)[:n]
