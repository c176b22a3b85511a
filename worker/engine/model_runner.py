"""Model runner: owns the KV cache tensors and turns one scheduled step into one batched forward.

Per step it builds, with a handful of numpy operations over the whole batch (no per-token Python
loops), the packed token ids and positions of every scheduled request, the attention metadata
(query_start_loc, seq_lens, block_tables, slot_mapping) and the indices of the positions that
sample: the last token of each request whose computed tokens catch up with its total this step
(decodes, and prefill chunks that finish the prompt). Only those rows go through the LM head.

Block tables live in a persistent host buffer with one row per running request; a step copies only
the blocks a request gained since the last step, so building the batch costs O(batch), not
O(batch x context).
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.request import Request


@dataclass
class StepInputs:
    """Host-side description of one step (kept for stats and tests)."""

    num_tokens: int
    num_seqs: int
    sample_requests: list[Request]  # requests that produce a token this step, in batch order
    prompt_tokens_computed: int  # tokens of this step at prompt positions (prefill work)
    live_tokens: int  # tokens with KV after this step, summed over the batch's requests
    slots_allocated: int  # block slots those requests hold


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def _zeros_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor; on a Linux CPU backed by transparent huge pages when allowed.

    Why: decode attention reads each sequence's blocks, which lie scattered over the whole cache, so
    with 4 KiB pages nearly every block costs TLB misses. Asking for 2 MiB pages (madvise, honoured
    when THP is in "madvise" or "always" mode) made the CPU decode attention kernel ~20% faster on
    scattered blocks. Where that is unavailable this is plain torch.zeros.
    """
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel + _HUGE_PAGE // item, dtype=dtype)  # room to align the start to 2 MiB
    start = (-raw.data_ptr()) % _HUGE_PAGE // item
    tensor = raw[start : start + numel]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes - nbytes % _HUGE_PAGE), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # only advice: without it the cache works the same, a little slower
    return tensor.zero_().view(shape)  # zeroing after the advice maps the pages as huge pages


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled: padded attention lanes may read never-written slots; zeros keep them finite.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_zeros_kv(shape, dtype, device), _zeros_kv(shape, dtype, device)) for _ in range(num_layers)
        ]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._synced = np.zeros(max_num_seqs, dtype=np.int64)  # blocks copied into each row
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._pin = device.type == "cuda"
        # Wall-clock seconds of the last forward (model + LM head), for the overhead stat.
        self.last_forward_s = 0.0
        self._logits: torch.Tensor | None = None  # see _logits_buffer
        self._max_num_seqs = max_num_seqs

    @staticmethod
    def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------------ rows
    def release(self, request: Request) -> None:
        """The request left the running set (finished or preempted): free its block-table row."""
        if request.runner_row >= 0:
            self._free_rows.append(request.runner_row)
            request.runner_row = -1

    def _sync_rows(self, requests: Sequence[Request]) -> np.ndarray:
        rows = np.empty(len(requests), dtype=np.int64)
        tables, synced = self._tables, self._synced
        for i, r in enumerate(requests):
            row = r.runner_row
            if row < 0:
                row = r.runner_row = self._free_rows.pop()
                synced[row] = 0
            bt = r.kv.block_table
            have = synced[row]
            if have != len(bt):
                tables[row, have : len(bt)] = bt[have:]
                synced[row] = len(bt)
            rows[i] = row
        return rows

    # ------------------------------------------------------------------ one step
    def prepare(
        self, requests: Sequence[Request], num_new_tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None, StepInputs]:
        bs = self.block_size
        num_seqs = len(requests)
        rows = self._sync_rows(requests)
        n = np.fromiter(num_new_tokens, dtype=np.int64, count=num_seqs)
        ctx = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_seqs)
        totals = np.fromiter((r.num_tokens for r in requests), dtype=np.int64, count=num_seqs)
        prompt_lens = np.fromiter((r.num_prompt_tokens for r in requests), dtype=np.int64, count=num_seqs)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = ctx + n

        if num_tokens == num_seqs:  # pure decode step: one token per request
            ids = [r.kv.token_ids[c] for r, c in zip(requests, ctx.tolist(), strict=True)]
            positions = ctx
            token_rows = rows
        else:
            ids = []
            for r, c, k in zip(requests, ctx.tolist(), n.tolist(), strict=True):
                ids.extend(r.kv.token_ids[c : c + k])
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, n)
            token_rows = np.repeat(rows, n)
        slots = self._tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_seq_len = int(seq_lens.max())
        block_tables = self._tables[rows, : -(-max_seq_len // bs)]

        samples = seq_lens == totals
        if samples.all():
            sample_requests = list(requests)
            logits_index = None if num_tokens == num_seqs else qsl[1:] - 1
        else:
            sample_requests = [r for r, s in zip(requests, samples.tolist(), strict=True) if s]
            logits_index = qsl[1:][samples] - 1

        stats = StepInputs(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            sample_requests=sample_requests,
            prompt_tokens_computed=int(np.clip(np.minimum(seq_lens, prompt_lens) - ctx, 0, None).sum()),
            live_tokens=int(seq_lens.sum()),
            slots_allocated=int(sum(len(r.kv.block_table) for r in requests)) * bs,
        )
        dev = self._to_device
        meta = AttentionMetadata(
            query_start_loc=dev(qsl.astype(np.int32)),
            seq_lens=dev(seq_lens.astype(np.int32)),
            block_tables=dev(np.ascontiguousarray(block_tables)),
            slot_mapping=dev(slots),
            max_query_len=int(n.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids = dev(np.asarray(ids, dtype=np.int64))
        pos_t = dev(np.ascontiguousarray(positions))
        idx = None if logits_index is None else dev(logits_index)
        return input_ids, pos_t, meta, idx, stats

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cpu":
            return t
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _logits_buffer(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """A reused float32 [rows, vocab] buffer for the LM head on the CPU (None elsewhere).

        A fresh [256, 32000] float32 tensor is over 32 MiB, so the allocator maps new pages for it
        every step (~16 ms of page faults on a small CPU); one buffer, grown on demand, avoids that.
        The logits are only read by the sampler within the same step, so overwriting them next step
        is safe.
        """
        if hidden.device.type != "cpu" or hidden.dtype != torch.float32:
            return None
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is None:
            return None
        rows = hidden.shape[0]
        buf = self._logits
        if buf is None or buf.shape[0] < rows:
            # Sized for the largest batch at once, so growing batches do not re-map it step after step.
            # Zero-filled so its pages are mapped now (e.g. during a warm-up), not in a later big step.
            buf = self._logits = torch.zeros(max(rows, self._max_num_seqs), vocab, dtype=torch.float32)
        return buf[:rows]

    def execute(self, requests: Sequence[Request], num_new_tokens: Sequence[int]) -> tuple[torch.Tensor | None, StepInputs]:
        """Run one batched forward; returns float32 logits [num sampling requests, vocab] (or None)."""
        # Metadata is built outside inference mode: backends may key per-step plans on tensor versions.
        input_ids, positions, meta, logits_index, stats = self.prepare(requests, num_new_tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            logits = None
            if stats.sample_requests:
                if logits_index is not None:
                    hidden = hidden.index_select(0, logits_index)
                logits = self.model.compute_logits(hidden, out=self._logits_buffer(hidden))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - t0
        return logits, stats
