"""Model runner: owns the KV cache tensors and turns one scheduled step into one batched forward.

Per step it builds, with a handful of numpy operations over the whole batch (no per-token Python
loops), the packed token ids and positions of every scheduled request, the attention metadata
(query_start_loc, seq_lens, block_tables, slot_mapping) and the indices of the positions that
sample: the last token of each request whose computed tokens catch up with its total this step
(decodes, and prefill chunks that finish the prompt). Only those rows go through the LM head.
A step that holds prompt positions a request scores (prompt_logprobs, scoring.py) also gives those
positions the full last layer (extra OutputRows after the sampling rows) and scores them in
bounded chunks before the sampling rows' logits are computed.

Block tables live in a persistent host buffer with one row per running request; a step copies only
the blocks a request gained since the last step, so building the batch costs O(batch), not
O(batch x context).

GPU path (see docs/engine.md, "GPU path"): decode-only steps that fit a captured size replay a CUDA
graph (cuda_graphs.py); step inputs go through persistent pinned host buffers with non-blocking
copies; nothing in a step waits for the GPU (the engine's read of the sampled token ids is the
only synchronisation); and a decode row may take its input token from the previous step's sampled
ids while they are still on the device (overlapped steps: `execute(out, pending)`).

Each step's SchedulerOutput names the requests that finished or were preempted since the last one:
execute frees their block-table rows before it places the step's requests.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, getitem
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.engine.attention import AttentionMetadata, OutputRows
from tokenmill.engine.cpu.host_memory import HUGE_PAGE
from tokenmill.engine.cpu.step_parts import StepPartPool, plan_parts
from tokenmill.engine.cuda_graphs import DecodeGraphRunner, capture_sizes
from tokenmill.engine.request import PENDING_TOKEN, Request
from tokenmill.engine.sampler import LogitEdits, Sampler, SamplingInputs, logit_edits
from tokenmill.engine.scoring import ScoreRows, record_scores, score_rows
from tokenmill.kernels.cpu.greedy_screen import AllowedIds

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import SchedulerOutput
    from tokenmill.engine.structured.constraints import StepMask, StepMaskRows

log = logging.getLogger(__name__)

GRAPH_MODES = ("off", "on", "eager")


@dataclass
class StepInputs:
    """Host-side description of one step (kept for stats and tests)."""

    num_tokens: int
    num_seqs: int
    sample_requests: list[Request]  # requests that produce a token this step, in batch order
    prompt_tokens_computed: int  # tokens of this step at prompt positions (prefill work)
    live_tokens: int  # tokens with KV after this step, summed over the batch's requests
    slots_allocated: int  # block slots those requests hold
    scores: ScoreRows | None = None  # prompt positions scored this step (their rows follow the sampling rows)


@dataclass
class PendingTokens:
    """The previous step's sampled ids, still on the device (overlapped steps): a decode row of
    one of these requests whose input token is PENDING_TOKEN on the host reads it from here."""

    ids: torch.Tensor  # [len(requests)] sampled ids, on the device
    requests: Sequence[Request]  # the requests that sampled them, in row order


@dataclass
class GreedyIds:
    """What a step returns instead of logits when every sampling row is plain greedy and the model
    found their argmax without the full LM head (kernels/cpu/greedy_screen.py): the ids [rows], on
    the CPU."""

    ids: torch.Tensor


@dataclass
class SomeIds:
    """What a step returns when some of its sampling rows are greedy without logprobs and the
    others need logits: the greedy rows' ids found by the greedy screen (`ids`, for the sampling
    rows `id_rows`), and the full LM head's logits of the others only (`logits`, for `logit_rows`),
    so that one logprobs or sampled row does not send every greedy row of the step to the full
    head. On the CPU. In a step with a constraint's mask, the screened rows took theirs, and `mask`
    is the mask of the logits rows, for the sampler."""

    ids: torch.Tensor
    id_rows: list[int]
    logits: torch.Tensor
    logit_rows: list[int]
    mask: StepMaskRows | None = None


_MADV_HUGEPAGE = 14  # Linux


# Per-request reads of a step's inputs (ModelRunner.prepare).
_runner_row = attrgetter("runner_row")
_computed = attrgetter("num_computed_tokens")
_prompt_len = attrgetter("num_prompt_tokens")
_token_ids = attrgetter("kv.token_ids")
_block_table = attrgetter("kv.block_table")
_max_tokens = attrgetter("sampling.max_tokens")
_prompt_scores = attrgetter("prompt_scores")


def _kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, zeroed: bool) -> torch.Tensor:
    """A KV cache tensor; on a Linux CPU backed by transparent huge pages when allowed, and left
    unwritten unless `zeroed`.

    Unwritten: no attention path reads a slot its sequence has not written (each row reads its
    positions below its length; the torch decode path's padded lanes read the row's first slot;
    tests/test_kv_cache_unwritten.py fills a cache with NaN to hold them to it). Zeroing would only
    cost start time, in proportion to the cache's size (a 2 GiB SmolLM2 cache took 2-7 s on a
    2-core EPYC), and map every page at once; unwritten, a page is mapped when a step first writes
    into it. The padded decode path of captured graphs (and its eager twin) gives its padding rows
    slot 0 of block 0 to read, so a cache under it is zeroed; on CUDA zeroing is quick anyway.

    Huge pages: decode attention reads each sequence's blocks, which lie scattered over the whole
    cache, so with 4 KiB pages nearly every block costs TLB misses. Asking for 2 MiB pages (madvise,
    honoured when THP is in "madvise" or "always" mode) made the CPU decode attention kernel ~20%
    faster on scattered blocks. The advice needs no page mapped now: each 2 MiB span becomes a huge
    page when a step first writes into it, so the cache's size costs nothing at start.
    """
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device) if zeroed else torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * item
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype) if zeroed else torch.empty(shape, dtype=dtype)
    raw = torch.empty(numel + HUGE_PAGE // item, dtype=dtype)  # room to align the start to 2 MiB
    start = (-raw.data_ptr()) % HUGE_PAGE // item
    tensor = raw[start : start + numel]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # only advice: without it the cache works the same, a little slower
    if zeroed:
        tensor.zero_()  # after the advice, so the pages map as huge pages
    return tensor.view(shape)


class PinnedStaging:
    """Persistent pinned host buffers for a step's inputs, copied to the device without blocking.

    Allocated once at their largest size (per name: a capacity in elements and a dtype); a step
    fills leading slices from numpy arrays and starts non-blocking copies. A copy from pinned
    memory may still be reading its buffer when the host moves on, so there are two sets used in
    turn, and each records a CUDA event after its copies: before a set is refilled (two steps
    later) the host waits on that event. By then the GPU has long passed those copies (the engine
    has read the sampled tokens of a step after them), so the wait does not stall in practice.

    Without CUDA (pin=False, tests on the CPU) the same code runs and events are skipped.
    """

    def __init__(self, capacities: dict[str, tuple[int, torch.dtype]], device: torch.device, pin: bool = True) -> None:
        self.device = device
        self._sets = [
            {name: torch.empty(cap, dtype=dtype, pin_memory=pin) for name, (cap, dtype) in capacities.items()}
            for _ in range(2)
        ]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._current = 1
        self.num_unstaged = 0  # arrays larger than their buffer, copied the slow way (should stay 0)

    def begin_step(self) -> None:
        """Switch to the other set; wait until its previous copies have left it."""
        self._current ^= 1
        event = self._events[self._current]
        if event is not None:
            event.synchronize()

    def upload(self, name: str, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, through this step's pinned buffer `name` (same shape and dtype)."""
        buf = self._sets[self._current][name]
        if array.size > buf.numel():
            self.num_unstaged += 1
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
        view = buf[: array.size].view(array.shape)
        np.copyto(view.numpy(), array, casting="same_kind")
        return view.to(self.device, non_blocking=True)

    def end_step(self) -> None:
        """Mark the point after this step's copies (on CUDA)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[self._current] = event


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
        max_num_batched_tokens: int | None = None,
        graph_mode: str = "off",
        step_parts: StepPartPool | None = None,
        key_weight: float = 0.0,
        head_weight: float = 0.0,
    ) -> None:
        """step_parts: on the CPU, run a step's model body as parts side by side on this pool's
        threads (cpu/step_parts.py); key_weight and head_weight: one attended key's and one sampling
        row's work against one token's projections, for cutting steps into even parts."""
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {graph_mode!r}")
        self.model = model
        self.graph_mode = graph_mode
        self.device = device
        self._on_cpu = device.type == "cpu"  # asked for every step input
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Left unwritten where nothing reads a slot before its K/V is written (see _kv_tensor).
        zeroed = device.type != "cpu" or graph_mode != "off"
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_kv_tensor(shape, dtype, device, zeroed=zeroed), _kv_tensor(shape, dtype, device, zeroed=zeroed))
            for _ in range(num_layers)
        ]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._synced = np.zeros(max_num_seqs, dtype=np.int64)  # blocks copied into each row
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._logits: torch.Tensor | None = None  # see _logits_buffer
        self._max_num_seqs = max_num_seqs
        # Wall-clock seconds of the last forward call (model + LM head): its run time on the CPU,
        # only the time to enqueue it on CUDA (see execute).
        self.last_forward_s = 0.0
        self.forward_start: torch.cuda.Event | None = None
        max_tokens = max(max_num_batched_tokens or 0, max_num_seqs)
        self._staging = self._make_staging(max_tokens) if device.type == "cuda" else None
        # Decode steps through padded static buffers: replayed CUDA graphs ("on") or run eagerly
        # ("eager", the same path without capture, for tests on a CPU).
        self.graph_runner: DecodeGraphRunner | None = None
        if graph_mode != "off":
            self.graph_runner = DecodeGraphRunner(
                model, self.kv_caches, max_blocks_per_seq=self.max_blocks_per_seq,
                batch_sizes=capture_sizes(max_num_seqs), use_graphs=graph_mode == "on",
            )
        self.num_graph_steps = 0  # steps run by the graph runner (tests check the path is taken)
        self.step_parts = step_parts if device.type == "cpu" and self.graph_runner is None else None
        self._key_weight, self._head_weight = key_weight, head_weight
        self.num_split_steps = 0  # steps whose model body ran as parts (tests check the path is taken)
        if self.step_parts is not None:
            weakref.finalize(self, self.step_parts.stop)  # an engine dropped takes its threads along

    def _make_staging(self, max_tokens: int) -> PinnedStaging:
        seqs, width = self._max_num_seqs, self.max_blocks_per_seq
        return PinnedStaging(
            {
                "input_ids": (max_tokens, torch.int64),
                "positions": (max_tokens, torch.int64),
                "slot_mapping": (max_tokens, torch.int64),
                "query_start_loc": (seqs + 1, torch.int32),
                "seq_lens": (seqs, torch.int32),
                "block_tables": (seqs * width, torch.int32),
                # Output rows: one per sampling request, plus the step's scored prompt positions.
                "output_index": (seqs + max_tokens, torch.int64),
                "output_query_start_loc": (seqs + max_tokens + 1, torch.int32),
                "output_seq_lens": (seqs + max_tokens, torch.int32),
                "output_block_tables": ((seqs + max_tokens) * width, torch.int32),
                "pending_dst": (seqs, torch.int64),
                "pending_src": (seqs, torch.int64),
            },
            self.device,
        )

    def capture_graphs(self, *, fall_back: bool = False) -> None:
        """Capture the decode graphs (CUDA, graph_mode "on"); call once the KV cache exists and
        before the first real step. A no-op otherwise. With fall_back (graphs only chosen by
        "auto"), a capture that fails (e.g. an op that cannot be captured on this GPU) leaves the
        runner without graphs (graph_mode "off"), with a warning; otherwise the failure is raised."""
        if self.graph_runner is None:
            return
        try:
            self.graph_runner.capture()
        except Exception:
            if not fall_back:
                raise
            log.warning("CUDA graph capture failed; decode steps run without graphs", exc_info=True)
            self.graph_runner = None
            self.graph_mode = "off"

    @staticmethod
    def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer: the forked choices of an
        n > 1 request get their own copy of the prompt's last, partly filled block. Queued after
        the forward that wrote the sources (the same stream on CUDA)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for k, v in self.kv_caches:
                k.index_copy_(0, dst, k.index_select(0, src))
                v.index_copy_(0, dst, v.index_select(0, src))

    # ------------------------------------------------------------------ rows
    @property
    def num_rows_in_use(self) -> int:
        """Block-table rows held by requests (0 once every request's end was named in a step)."""
        return self._max_num_seqs - len(self._free_rows)

    def _release_rows(self, out: SchedulerOutput) -> None:
        """Free the block-table rows of the requests that left the running set since the last step."""
        free = self._free_rows
        for group in (out.finished, out.preempted):
            for request in group:
                if request.runner_row >= 0:
                    free.append(request.runner_row)
                    request.runner_row = -1

    def _sync_rows(self, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
        """(each request's row of the block table, the blocks each holds): a free row for a request
        new to the runner, and the blocks added since a row's last step copied in. The checks run
        over all rows at once; the Python loops only over the rows that need something (a request
        crosses into a new block once every block_size tokens)."""
        count = len(requests)
        rows = np.fromiter(map(_runner_row, requests), dtype=np.int64, count=count)
        synced, tables = self._synced, self._tables
        for i in np.flatnonzero(rows < 0).tolist():
            row = requests[i].runner_row = self._free_rows.pop()
            synced[row] = 0
            rows[i] = row
        held = np.fromiter(map(len, map(_block_table, requests)), dtype=np.int64, count=count)
        for i in np.flatnonzero(synced[rows] != held).tolist():
            row, bt = int(rows[i]), requests[i].kv.block_table
            have = int(synced[row])
            tables[row, have : len(bt)] = bt[have:]
            synced[row] = len(bt)
        return rows, held

    # ------------------------------------------------------------------ one step
    def prepare(
        self, requests: Sequence[Request], num_new_tokens: Sequence[int], pending: PendingTokens | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, OutputRows | None, StepInputs]:
        bs = self.block_size
        num_seqs = len(requests)
        rows, blocks_held = self._sync_rows(requests)
        # The per-request reads go through operator's getters (C, no Python frame per request):
        # a decode step reads hundreds of requests several times over, on the step's serial path.
        n = np.fromiter(num_new_tokens, dtype=np.int64, count=num_seqs)
        ctx = np.fromiter(map(_computed, requests), dtype=np.int64, count=num_seqs)
        token_lists = list(map(_token_ids, requests))
        totals = np.fromiter(map(len, token_lists), dtype=np.int64, count=num_seqs)  # Request.num_tokens
        prompt_lens = np.fromiter(map(_prompt_len, requests), dtype=np.int64, count=num_seqs)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = ctx + n

        if num_tokens == num_seqs:  # pure decode step: one token per request
            ids = list(map(getitem, token_lists, ctx.tolist()))
            positions = ctx
            token_rows = rows
        else:
            ids = []
            for token_ids, c, k in zip(token_lists, ctx.tolist(), n.tolist(), strict=True):
                ids.extend(token_ids[c : c + k])
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, n)
            token_rows = np.repeat(rows, n)
        slots = self._tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_seq_len = int(seq_lens.max())
        block_tables = self._tables[rows, : -(-max_seq_len // bs)]

        samples = seq_lens == totals
        # A score-only request (max_tokens 0) samples nothing: it ends once its prompt is computed.
        # (`0 in map(...)` and the count below run in C: most steps have neither kind of request.)
        if 0 in map(_max_tokens, requests):
            samples &= np.fromiter(map(_max_tokens, requests), dtype=np.int64, count=num_seqs) != 0
        scoring = list(map(_prompt_scores, requests)).count(None) < num_seqs
        scores = score_rows(requests, ctx, n, qsl) if scoring else None
        if samples.all():
            sample_requests = list(requests)
            logits_index = None if num_tokens == num_seqs and scores is None else qsl[1:] - 1
        else:
            sample_requests = [r for r, s in zip(requests, samples.tolist(), strict=True) if s]
            logits_index = qsl[1:][samples] - 1

        stats = StepInputs(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            sample_requests=sample_requests,
            prompt_tokens_computed=int(np.maximum(np.minimum(seq_lens, prompt_lens) - ctx, 0).sum()),
            live_tokens=int(seq_lens.sum()),
            slots_allocated=int(blocks_held.sum()) * bs,
            scores=scores,
        )
        staging = self._staging
        if staging is not None:
            staging.begin_step()
        dev = self._to_device
        meta = AttentionMetadata(
            query_start_loc=dev("query_start_loc", qsl.astype(np.int32)),
            seq_lens=dev("seq_lens", seq_lens.astype(np.int32)),
            block_tables=dev("block_tables", np.ascontiguousarray(block_tables)),
            slot_mapping=dev("slot_mapping", slots),
            max_query_len=int(n.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        ids_np = np.asarray(ids, dtype=np.int64)
        fills = self._pending_inputs(requests, ids_np, qsl, ctx, n, totals, pending)
        input_ids = dev("input_ids", ids_np)
        if fills is not None:
            # Decode rows of requests whose last token is still on the device (overlapped steps):
            # take it from the previous step's sampled ids, without a round trip through the host.
            dst, src = dev("pending_dst", fills[0]), dev("pending_src", fills[1])
            input_ids.index_copy_(0, dst, pending.ids.index_select(0, src))
        pos_t = dev("positions", np.ascontiguousarray(positions))
        output_rows = None
        if logits_index is not None:
            out_lens = seq_lens[samples]
            out_tables = block_tables[samples]
            if scores is not None:
                # Each scored position is a query of its own that attends to the tokens before it.
                logits_index = np.concatenate([logits_index, scores.flat_index])
                out_lens = np.concatenate([out_lens, scores.seq_lens])
                out_tables = np.concatenate([out_tables, block_tables[scores.batch_index]])
            out_max = int(out_lens.max()) if len(out_lens) else 0
            output_rows = OutputRows(
                index=dev("output_index", logits_index),
                meta=AttentionMetadata(
                    query_start_loc=dev("output_query_start_loc", np.arange(len(out_lens) + 1, dtype=np.int32)),
                    seq_lens=dev("output_seq_lens", out_lens.astype(np.int32)),
                    block_tables=dev(
                        "output_block_tables", np.ascontiguousarray(out_tables[:, : -(-out_max // bs)])
                    ),
                    slot_mapping=meta.slot_mapping[:0],  # writes nothing: the K/V is in place already
                    max_query_len=1,
                    max_seq_len=out_max,
                    query_start_loc_cpu=list(range(len(out_lens) + 1)),
                    seq_lens_cpu=out_lens.tolist(),
                ),
            )
        if staging is not None:
            staging.end_step()
        return input_ids, pos_t, meta, output_rows, stats

    def _pending_inputs(
        self, requests: Sequence[Request], ids: np.ndarray, qsl: np.ndarray, ctx: np.ndarray,
        n: np.ndarray, totals: np.ndarray, pending: PendingTokens | None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat token index, row of pending.ids) of every input token that is PENDING_TOKEN on
        the host, or None when there is none.

        A pending token is always its request's last token, so it is in this step exactly when the
        request's chunk reaches its end.
        """
        dst: list[int] = []
        src: list[int] = []
        if pending is not None and pending.requests:
            prev = {r: i for i, r in enumerate(pending.requests)}
            for i, r in enumerate(requests):
                row = prev.get(r)
                if row is not None and ctx[i] + n[i] == totals[i]:
                    dst.append(int(qsl[i] + n[i] - 1))
                    src.append(row)
        placeholders = int(np.count_nonzero(ids == PENDING_TOKEN))
        if placeholders != len(dst) or any(ids[d] != PENDING_TOKEN for d in dst):
            raise RuntimeError(
                f"{placeholders} input token(s) are still being sampled but {len(dst)} can be filled "
                "from the previous step's sampled ids"
            )
        if not dst:
            return None
        return np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)

    def _to_device(self, name: str, a: np.ndarray) -> torch.Tensor:
        if self._on_cpu:
            return torch.from_numpy(a)
        if self._staging is not None:
            return self._staging.upload(name, a)
        return torch.from_numpy(a).to(self.device)

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

    def execute(
        self, out: SchedulerOutput, pending: PendingTokens | None = None, argmax_ok: bool = False,
        token_mask: StepMask | None = None,
    ) -> tuple[torch.Tensor | GreedyIds | SomeIds | None, StepInputs | None]:
        """Free the rows of the requests `out` names as finished or preempted, then launch one
        batched forward over its requests; returns float32 logits [num sampling requests, vocab]
        (None when no row samples) and the step's StepInputs (both None for an empty step).

        `pending`: the previous step's sampled ids when they are not on the host yet.
        `argmax_ok`: the caller needs no logits row but each row's sampled token (no fork): when
        every sampling row is then plain greedy, the result may be GreedyIds instead, taken under
        `token_mask` (the step's constraint mask, applied to the greedy screen) where there is one.
        Nothing here waits for the GPU: on CUDA the logits are still being computed when this
        returns. last_forward_s is the forward's wall time on the CPU (where it runs synchronously);
        on CUDA, forward_start is a CUDA event recorded just before the forward, for timing it.
        """
        self._release_rows(out)
        if out.is_empty:
            return None, None
        cuts = self._plan_parts(out) if self.step_parts is not None and pending is None else None
        if cuts is not None:
            return self._execute_in_parts(out, cuts, argmax_ok, token_mask)
        return self._execute_whole(out, pending, argmax_ok, token_mask)

    def _execute_whole(
        self, out: SchedulerOutput, pending: PendingTokens | None, argmax_ok: bool, token_mask: StepMask | None
    ) -> tuple[torch.Tensor | GreedyIds | SomeIds | None, StepInputs | None]:
        # Metadata is built outside inference mode: backends may key per-step plans on tensor versions.
        input_ids, positions, meta, output_rows, stats = self.prepare(out.requests, out.num_new_tokens, pending)
        self.forward_start = None
        if self.device.type == "cuda":
            self.forward_start = torch.cuda.Event(enable_timing=True)
            self.forward_start.record()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self._graph_can_run(meta, output_rows, stats):
                logits = self.graph_runner.run(input_ids, positions, meta)
                self.num_graph_steps += 1
            else:
                logits = self._forward(input_ids, positions, meta, output_rows, stats, argmax_ok, token_mask)
        self.last_forward_s = time.perf_counter() - t0
        return logits, stats

    def _graph_can_run(self, meta: AttentionMetadata, output_rows: OutputRows | None, stats: StepInputs) -> bool:
        """A decode-only step where every row samples, in a size the graph runner holds."""
        return (
            self.graph_runner is not None
            and output_rows is None
            and stats.num_tokens == stats.num_seqs == len(stats.sample_requests)
            and self.graph_runner.can_run(meta)
        )

    def _plan_parts(self, out: SchedulerOutput) -> list[slice] | None:
        """How the step's requests would be cut into parts (cpu/step_parts.py); None when the step
        does not split well (uneven work, too small) or scores prompt positions (their rows are
        not cut)."""
        requests = out.requests
        if any(r.prompt_scores is not None for r in requests):
            return None
        n = np.fromiter(out.num_new_tokens, dtype=np.int64, count=len(requests))
        seq_lens = n + np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=len(requests))
        samples = seq_lens == np.fromiter((r.num_tokens for r in requests), dtype=np.int64, count=len(requests))
        return plan_parts(n, seq_lens, self.step_parts.parts, self._key_weight, samples, self._head_weight)

    def _execute_in_parts(
        self, out: SchedulerOutput, cuts: list[slice], argmax_ok: bool, token_mask: StepMask | None
    ) -> tuple[torch.Tensor | GreedyIds | SomeIds | None, StepInputs]:
        """The step with its model body cut into parts run side by side on the pool's threads, and
        the greedy rows' ids found there too; the full LM head, where needed, once over the joined
        rows."""
        requests, num_new = out.requests, out.num_new_tokens
        parts = [self.prepare(requests[c], num_new[c]) for c in cuts]
        stats = _joined([p[4] for p in parts])
        # Greedy rows' ids come out of the parts too (the screen, on each part's thread), so that
        # the calling thread runs no parallel region of its own in such a step: under OpenMP's
        # default wait policy its idle team would spin on a core the parts need.
        want_ids = bool(stats.sample_requests) and argmax_ok and Sampler.argmax_is_enough(
            [r.sampling_inputs for r in stats.sample_requests], edits_ok=True)
        t0 = time.perf_counter()
        # Each part's screen takes its own rows of the step's mask: those from its first sampling row.
        firsts = np.cumsum([0] + [len(p[4].sample_requests) for p in parts[:-1]]).tolist()
        masks = [None if token_mask is None else functools.partial(token_mask.allowed, first_row=f) for f in firsts]
        edits = [_edits_for([r.sampling_inputs for r in p[4].sample_requests]) for p in parts]
        with torch.inference_mode():
            done = self.step_parts.map(self._part, [(*p[:4], want_ids and bool(p[4].sample_requests), m, e)
                                                    for p, m, e in zip(parts, masks, edits, strict=True)])
            hidden = torch.cat([h for h, _ in done])
            ids = [i for _, i in done]
            if want_ids and all(i is not None for i, p in zip(ids, parts, strict=True) if p[4].sample_requests):
                result: torch.Tensor | GreedyIds | SomeIds | None = GreedyIds(torch.cat([i for i in ids if i is not None]))
            else:
                # Rows that need logits beside greedy ones (SomeIds where the screen takes the
                # greedy ones), or a screen that could not narrow a part's rows: the full head
                # over every row (the sampler masks its logits).
                result = self._head(hidden, stats, argmax_ok and not want_ids, token_mask)
        self.last_forward_s = time.perf_counter() - t0
        self.num_split_steps += 1
        return result, stats

    def _part(self, input_ids, positions, meta, output_rows, want_ids: bool,
              allowed: AllowedIds | None,
              edits_for: Callable[[int], LogitEdits | None] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One part of a split step, on its pool thread: its output rows, and their greedy ids (under
        the part's rows of the step's mask, after its rows' penalties) when wanted and the screen
        finds them (else None)."""
        hidden = self._body(input_ids, positions, meta, output_rows)
        return hidden, self.model.greedy_ids(hidden, allowed, edits_for) if want_ids else None

    def _body(self, input_ids, positions, meta, output_rows) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.kv_caches, output_rows)

    def _forward(self, input_ids, positions, meta, output_rows, stats, argmax_ok=False,
                 token_mask: StepMask | None = None) -> torch.Tensor | GreedyIds | SomeIds | None:
        # With output_rows (any step that is not pure decode) the hidden states are those rows only:
        # the sampling rows, then the scored prompt positions.
        hidden = self._body(input_ids, positions, meta, output_rows)
        num_samples = len(stats.sample_requests)
        if stats.scores is not None:
            # Waits for the device (the records go to the host); scoring requests keep steps
            # synchronous anyway (overlap.needs_host_history).
            record_scores(stats.scores, hidden[num_samples:], self.model)
            hidden = hidden[:num_samples]
        return self._head(hidden, stats, argmax_ok, token_mask)

    def _head(self, hidden: torch.Tensor, stats: StepInputs, argmax_ok: bool,
              token_mask: StepMask | None = None) -> torch.Tensor | GreedyIds | SomeIds | None:
        """The sampling rows' logits, or their greedy ids (see execute)."""
        num_samples = len(stats.sample_requests)
        if not num_samples:
            return None
        inputs = [r.sampling_inputs for r in stats.sample_requests]
        if argmax_ok and Sampler.argmax_is_enough(inputs, edits_ok=True):
            ids = self.model.greedy_ids(hidden, None if token_mask is None else token_mask.allowed, _edits_for(inputs))
            if ids is not None:
                return GreedyIds(ids)
        elif argmax_ok and hidden.device.type == "cpu":
            some = self._some_ids(hidden, inputs, token_mask)
            if some is not None:
                return some
        return self.model.compute_logits(hidden, out=self._logits_buffer(hidden))

    def _some_ids(self, hidden: torch.Tensor, inputs: list[SamplingInputs],
                  token_mask: StepMask | None = None) -> SomeIds | None:
        """A step whose rows are partly greedy without logprobs: those through the greedy screen
        (under their rows of the step's mask), the full head over the others only (SomeIds); None
        where no row or every row is greedy, or the screen does not take them (the caller computes
        every row's logits)."""
        id_rows = [i for i, inp in enumerate(inputs) if Sampler.argmax_is_enough((inp,), edits_ok=True)]
        if not id_rows or len(id_rows) == len(inputs):
            return None
        greedy_inputs = [inputs[i] for i in id_rows]
        allowed = None if token_mask is None else token_mask.of_rows(id_rows).allowed
        ids = self.model.greedy_ids(hidden[id_rows], allowed, _edits_for(greedy_inputs))
        if ids is None:
            return None
        taken = set(id_rows)
        logit_rows = [i for i in range(len(inputs)) if i not in taken]
        rest = hidden[logit_rows]
        return SomeIds(ids, id_rows, self.model.compute_logits(rest, out=self._logits_buffer(rest)), logit_rows,
                       None if token_mask is None else token_mask.of_rows(logit_rows))


def _joined(parts: Sequence[StepInputs]) -> StepInputs:
    """One StepInputs for a step computed as contiguous parts: sums, and the sampling requests in
    batch order."""
    return StepInputs(
        num_tokens=sum(p.num_tokens for p in parts),
        num_seqs=sum(p.num_seqs for p in parts),
        sample_requests=[r for p in parts for r in p.sample_requests],
        prompt_tokens_computed=sum(p.prompt_tokens_computed for p in parts),
        live_tokens=sum(p.live_tokens for p in parts),
        slots_allocated=sum(p.slots_allocated for p in parts),
    )


def _edits_for(inputs: list[SamplingInputs]) -> Callable[[int], LogitEdits | None] | None:
    """For greedy rows: None when no row has penalties or a min_tokens block (their argmax is the
    logits' own), else what builds the step's LogitEdits for a vocabulary (the greedy screen asks
    only where it runs, so a CPU without one does not build them twice)."""
    if Sampler.argmax_is_enough(inputs):
        return None
    return functools.partial(logit_edits, inputs, device=torch.device("cpu"))
