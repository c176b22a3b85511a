"""Paged attention without Triton: exact, and quick on the CPU for mixed batches of many sequences.

How one attend() call is organised (per layer; the plan behind it is built once per step):

- Decode rows (one query token), float32 on the CPU: the C kernel of kernels/cpu/decode_attention.py reads each
  row's K/V in place through its block table (no gather; about 2x faster than the torch path below).
- Prefill rows of at most KERNEL_PREFILL_MAX_LEN tokens (context included), float32 on the CPU: each
  query token goes to the same kernel as a row of its own that sees the keys up to its position. The
  row's K/V (written just before) stay in the core's L2 while its tokens read them, and the kernel
  splits all its rows over the threads by work. Measured against the SDPA path below (gather included),
  SmolLM2's shapes (9 / 3 heads): 1.28x faster at 252 tokens on one thread, 1.41x on two; tiny-llama's
  (4 / 2): 1.13x and 1.98x. From 1,024 tokens each token rereading the row's keys from L3 costs more
  than SDPA's tiles (26.4 against 22.8 ms at 1,024 on SmolLM2's shapes), so longer rows keep SDPA.
- Prefill rows of at least amx_prefill_attention.MIN_TOKENS new tokens, at any length, on a CPU with AMX
  tiles: the two GEMMs of each head on the tiles (kernels/cpu/amx_prefill_attention.py), about 2x the
  kernel above at 200-500 tokens. Shorter rows (a chunk after a long context) stay token rows.
- Decode rows otherwise (no C compiler, 16-bit, other devices) are sorted by context length and cut
  into buckets whose lengths are close, so padding stays small. Per bucket, one index_select gathers
  the rows' keys head-major into a reused workspace ([rows * kv_heads, length, head_dim]), likewise the values; then one baddbmm (scale
  and length mask fused in), a softmax and one bmm. The query heads that share a kv head are the M
  dimension of those GEMMs, so GQA costs no K/V copies. Measured on one CPU core this is ~2x faster
  than scaled_dot_product_attention on the same gathered data (whose CPU kernel is slow for 1-token
  queries).
- Prefill and chunked-prefill rows (many query tokens) attend in groups of equal shape (query length,
  sequence length), one SDPA call per group: their context plus new tokens are gathered block by
  block into the workspace; a fresh prefill uses SDPA's causal path, a chunk after cached context a
  causal mask shifted by the context length.

Which of these the backend takes is the engine's CpuPaths (kernels/cpu/paths.py), read once at
construction: the C kernel and the AMX prefill where it says so, the torch paths otherwise. A
batch-invariant engine (CpuPaths.batch_invariant) sends every token to the C kernel, prefill tokens
of any length too: a token then attends in one order whether it comes in a decode step, a chunk of
its prompt, a whole prompt or a recompute after preemption (SDPA's and the tiles' orders differ).

Why the workspaces: a gather of tens of MB into a freshly allocated tensor costs several times the
copy itself on Linux (the allocator hands the pages back and every step faults them in again).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.engine.attention.metadata import AttentionMetadata
from tokenmill.kernels.cpu import amx_prefill_attention, decode_attention, elementwise
from tokenmill.kernels.cpu.paths import CpuPaths, default_cpu_paths

# Decode bucketing: a bucket grows while its longest row has at most this factor more blocks than its
# shortest (sorted ascending), so padded work is bounded by ~1.25x the real work; tiny buckets cost
# more in per-call overhead than padding saves, hence the minimum.
_BUCKET_GROWTH = 1.25
_MIN_BUCKET_ROWS = 16


@dataclass
class _DecodeBucket:
    token_index: torch.Tensor  # long [n]: where the rows' query tokens sit in the packed query
    # long [n * kv_heads * length]: for row r, kv head h, key position p, the row of the cache viewed
    # as [num_slots * kv_heads, head_dim] (slot * kv_heads + h); gathering these gives K laid out
    # [n * kv_heads, length, head_dim], contiguous per (row, head), ready for one bmm.
    cache_rows: torch.Tensor
    length: int  # keys per row in this bucket (padded to whole blocks)
    key_bias: torch.Tensor  # [n * kv_heads, 1, length] in the query dtype: 0 where a key exists, -inf after


@dataclass
class _PrefillGroup:
    """Prefill / extend rows of one shape (same query length and sequence length), attended together:
    in a prefix-cache workload many rows are exactly alike (shared prefix cached, same suffix length)."""

    token_index: torch.Tensor  # long [n * q_len]: the rows' query tokens in the packed query, row-major
    block_ids: torch.Tensor  # long [n * n_blocks]
    num_rows: int
    q_len: int
    seq_len: int  # context + new tokens
    mask: torch.Tensor | None  # bool [q_len, seq_len] when there is cached context; None = plain causal


# The longest prefill row (context + new tokens) whose tokens go through the C kernel (see above).
KERNEL_PREFILL_MAX_LEN = 512


@dataclass
class _KernelRows:
    """The rows the C kernel attends, one query token each (it needs no buckets: it reads blocks in
    place): every decode row, and each token of a short prefill row with the length up to it."""

    block_tables: torch.Tensor  # int32 [B, W] contiguous
    token_index: torch.Tensor  # int64 [n]
    table_row: torch.Tensor  # int64 [n]
    seq_lens: torch.Tensor  # int32 [n]
    max_len: int


@dataclass
class _StepPlan:
    decode: list[_DecodeBucket]
    prefill: list[_PrefillGroup]
    all_tokens_decode_in_order: bool  # output can be written without an index_copy
    kernel_rows: _KernelRows | None = None  # set instead of `decode` when the C kernel runs
    # Prefill rows for the AMX kernel (amx_prefill_attention.py): (first token, block table row, tokens, context),
    # and the same as the int64 table its one call per layer reads (built once per step).
    amx_prefill: list[tuple[int, int, int, int]] | None = None
    amx_prefill_rows: torch.Tensor | None = None


class TorchAttentionBackend:
    """AttentionBackend in torch, plus the C decode kernel on the CPU (any device; the CPU default)."""

    name = "torch"
    # write_kv is a plain copy into the shared cache layout, so the layer's ops may write the cache
    # themselves in a pass fused with the rotary (models/ops.py, TorchOps.rotary_write_kv).
    kv_write_is_plain_copy = True

    def __init__(self, cpu_paths: CpuPaths | None = None) -> None:
        """cpu_paths: which C kernels take float32 CPU tensors (default: every one that runs here)."""
        paths = default_cpu_paths() if cpu_paths is None else cpu_paths
        self.use_cpu_kernel = paths.decode_attention  # decode and short prefill rows through the C kernel
        self.use_amx_prefill = paths.amx_prefill_attention  # long prefill rows on the AMX tiles
        self.use_cpu_elementwise = paths.elementwise  # the K/V write as one C pass
        # Every prefill row's tokens through the C kernel, at any length (else up to KERNEL_PREFILL_MAX_LEN).
        self.all_prefill_in_kernel = paths.batch_invariant
        # The step plan and the gather workspaces, per thread: the parts of a split CPU step
        # (engine/cpu/step_parts.py) run the layers on threads of their own, each with its own metadata.
        self._local = threading.local()

    def _state(self) -> threading.local:
        local = self._local
        if not hasattr(local, "workspace"):
            local.plan, local.plan_key, local.plan_meta = None, None, None
            local.workspace = {}
        return local

    # -- KV write -----------------------------------------------------------------------------
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if (self.use_cpu_elementwise and key.device.type == "cpu"
                and elementwise.write_kv(key, value, key_cache, value_cache, slot_mapping)):
            return
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    # -- attention ----------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        use_kernel = (
            self.use_cpu_kernel and query.device.type == "cpu" and query.dtype == torch.float32
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and query.stride(2) == 1 and query.stride(1) == query.shape[2]
        )
        use_amx_prefill = use_kernel and self.use_amx_prefill and amx_prefill_attention.applies(query.shape[2])
        plan = self._plan_for(meta, key_cache, query.dtype, query.device, use_kernel, use_amx_prefill)
        if plan.all_tokens_decode_in_order and len(plan.decode) == 1:
            bucket = plan.decode[0]
            return self._decode(query, key_cache, value_cache, bucket, scale, rows_in_order=True)
        out = torch.empty_like(query)
        if plan.kernel_rows is not None and plan.kernel_rows.token_index.numel():
            kd = plan.kernel_rows
            decode_attention.paged_decode_attention(
                query, key_cache, value_cache, kd.block_tables, kd.token_index, kd.table_row, kd.seq_lens,
                kd.max_len, out, scale,
            )
        if plan.amx_prefill:
            amx_prefill_attention.prefill_attention_rows(query, key_cache, value_cache, plan.kernel_rows.block_tables,
                                                   plan.amx_prefill_rows, out, scale)
        for bucket in plan.decode:
            out.index_copy_(0, bucket.token_index, self._decode(query, key_cache, value_cache, bucket, scale))
        for group in plan.prefill:
            out.index_copy_(0, group.token_index, self._prefill(query, key_cache, value_cache, group, scale))
        return out

    def decode_kernel_rows(self, meta: AttentionMetadata, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           head_dim: int) -> _KernelRows | None:
        """The step's rows for the C decode kernel when the kernel attends every token of the step
        (a pure decode step of float32 CPU tensors), else None. For a caller that runs the kernel
        itself (kernels/cpu/decode_layers.py); the plan is the one attend() builds and keeps for the step."""
        if not (self.use_cpu_kernel and key_cache.device.type == "cpu" and key_cache.dtype == torch.float32
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return None
        plan = self._plan_for(meta, key_cache, torch.float32, key_cache.device, True,
                              self.use_amx_prefill and amx_prefill_attention.applies(head_dim))
        rows = plan.kernel_rows
        if rows is None or plan.prefill or plan.amx_prefill or plan.decode or rows.token_index.numel() != meta.num_tokens:
            return None
        return rows

    def _decode(self, query, key_cache, value_cache, bucket: _DecodeBucket, scale, rows_in_order=False):
        n = bucket.token_index.numel()
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        k, v = self._gather(key_cache.view(-1, head_dim), value_cache.view(-1, head_dim), bucket.cache_rows)
        k = k.view(n * num_kv_heads, bucket.length, head_dim)
        v = v.view(n * num_kv_heads, bucket.length, head_dim)
        q = query if rows_in_order else query.index_select(0, bucket.token_index)
        # The `group` query heads sharing a kv head form the M dimension of one small GEMM, so GQA needs
        # no copy of K/V per query head.
        q = q.reshape(n * num_kv_heads, group, head_dim)
        scores = torch.baddbmm(bucket.key_bias, q, k.transpose(1, 2), alpha=scale)
        if scores.dtype == torch.float32:
            probs = torch.softmax(scores, dim=-1)
        else:  # 16-bit: normalise in float32, as fused attention kernels do
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        return torch.bmm(probs, v).view(n, num_heads, head_dim)

    def _prefill(self, query, key_cache, value_cache, group: _PrefillGroup, scale):
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        num_heads = query.shape[1]
        n, q_len, seq_len = group.num_rows, group.q_len, group.seq_len
        k, v = self._gather(key_cache, value_cache, group.block_ids)
        k = k.view(n, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)  # [n, kv_heads, seq_len, d]
        v = v.view(n, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
        q = query.index_select(0, group.token_index).view(n, q_len, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, is_causal=group.mask is None, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.transpose(1, 2).reshape(n * q_len, num_heads, head_dim)

    def _gather(self, key_cache, value_cache, index):
        """Copy rows `index` of the caches (first dimension) into reused workspaces: (keys, values)."""
        block_shape = key_cache.shape[1:]
        count = index.numel()
        need = count * block_shape.numel()
        ws_key = (key_cache.dtype, key_cache.device)
        workspaces = self._state().workspace
        ws = workspaces.get(ws_key)
        if ws is None or ws.shape[1] < need:
            # Grow geometrically so a slowly growing batch does not reallocate every step.
            size = max(need, int(ws.shape[1] * 1.5) if ws is not None else 0)
            ws = torch.empty(2, size, dtype=key_cache.dtype, device=key_cache.device)
            workspaces[ws_key] = ws
        k = torch.index_select(key_cache, 0, index, out=ws[0, :need].view(count, *block_shape))
        v = torch.index_select(value_cache, 0, index, out=ws[1, :need].view(count, *block_shape))
        return k, v

    # -- per-step plan ------------------------------------------------------------------------
    def _plan_for(self, meta: AttentionMetadata, key_cache: torch.Tensor, dtype: torch.dtype,
                  device: torch.device, use_kernel: bool, use_amx_prefill: bool = False) -> _StepPlan:
        # Every layer of a step calls attend() with the same metadata: build the plan once. The key
        # includes the block table's version counter, so an in-place update of a reused metadata
        # object is never served a stale plan.
        num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
        key = (id(meta), meta.block_tables._version, key_cache.shape, dtype, device, use_kernel, use_amx_prefill)
        state = self._state()
        if state.plan is not None and state.plan_key == key and state.plan_meta is meta:
            return state.plan
        state.plan = build_plan(meta, block_size, num_kv_heads, dtype, device, use_kernel=use_kernel,
                                num_blocks=num_blocks, use_amx_prefill=use_amx_prefill,
                                all_prefill_in_kernel=self.all_prefill_in_kernel)
        state.plan_key = key
        state.plan_meta = meta
        return state.plan


def _blocks_for(seq_len: int, block_size: int) -> int:
    return (seq_len + block_size - 1) // block_size


def build_plan(meta: AttentionMetadata, block_size: int, num_kv_heads: int = 1,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               use_kernel: bool = False, num_blocks: int | None = None, use_amx_prefill: bool = False,
               all_prefill_in_kernel: bool = False) -> _StepPlan:
    """use_amx_prefill (with use_kernel): prefill rows of at least amx_prefill_attention.MIN_TOKENS new tokens
    go to the AMX prefill kernel, at any length. all_prefill_in_kernel (with use_kernel): every prefill
    row's tokens go to the C kernel, not only rows of up to KERNEL_PREFILL_MAX_LEN."""
    starts = meta.query_start_loc_cpu
    seq_lens = meta.seq_lens_cpu
    if len(starts) != len(seq_lens) + 1:
        raise ValueError(
            f"query_start_loc has {len(starts)} entries for {len(seq_lens)} sequences (expected one more)"
        )
    # The table as given (the CPU runner's int32 rows): the kernel reads it in place, and the int64
    # copy that indexing wants is made only for the rows that need one (below).
    given = meta.block_tables if meta.block_tables.device.type == "cpu" else meta.block_tables.cpu()
    max_blocks = given.shape[1] if given.dim() == 2 else 0
    tables_long: torch.Tensor | None = None

    def tables() -> torch.Tensor:
        nonlocal tables_long
        if tables_long is None:
            tables_long = given.to(dtype=torch.long)
        return tables_long
    # The rows are checked and sorted with numpy (a Python loop over a decode step's few hundred
    # rows was a tenth of a millisecond on the step's serial path); errors name the first bad row.
    start_a = np.asarray(starts, dtype=np.int64)
    len_a = np.asarray(seq_lens, dtype=np.int64)
    q_a = start_a[1:] - start_a[:-1]
    bad_len = (q_a != 0) & ((q_a < 0) | (q_a > len_a))
    bad_table = (q_a != 0) & ((len_a + block_size - 1) // block_size > max_blocks)
    bad = np.flatnonzero(bad_len | bad_table)
    if bad.size:
        row = int(bad[0])
        q_len, seq_len = int(q_a[row]), int(len_a[row])
        if bad_len[row]:
            raise ValueError(f"row {row}: {q_len} query tokens for a sequence of length {seq_len}")
        n_blocks = _blocks_for(seq_len, block_size)
        raise ValueError(f"row {row}: length {seq_len} needs {n_blocks} blocks, block table has {max_blocks}")
    decode_a = np.flatnonzero(q_a == 1)
    prefill_rows: dict[tuple[int, int], list[int]] = {}  # (q_len, seq_len) -> rows, in row order
    for row in np.flatnonzero(q_a > 1).tolist():
        prefill_rows.setdefault((starts[row + 1] - starts[row], seq_lens[row]), []).append(row)

    # With the kernel, a short prefill row's tokens become kernel rows: pieces of (token index, table
    # row, length), the decode rows first.
    kernel_pieces = [(torch.from_numpy(start_a[decode_a]), torch.from_numpy(decode_a.astype(np.int64)),
                      torch.from_numpy(len_a[decode_a].astype(np.int32)))] if use_kernel else []
    decode_rows = decode_a.tolist() if not use_kernel else []
    prefill: list[_PrefillGroup] = []
    amx_prefill: list[tuple[int, int, int, int]] = []
    for (q_len, seq_len), rows in prefill_rows.items():
        context = seq_len - q_len
        if use_kernel and use_amx_prefill and q_len >= amx_prefill_attention.MIN_TOKENS:
            amx_prefill += [(starts[r], r, q_len, context) for r in rows]
            continue
        if use_kernel and (all_prefill_in_kernel or seq_len <= KERNEL_PREFILL_MAX_LEN):
            for r in rows:  # query token i sits at position context + i and sees keys 0 .. context + i
                kernel_pieces.append((torch.arange(starts[r], starts[r] + q_len),
                                      torch.full((q_len,), r, dtype=torch.long),
                                      torch.arange(context + 1, seq_len + 1, dtype=torch.int32)))
            continue
        mask = None
        if context:
            # Query token i sits at position context + i and sees keys 0 .. context + i.
            key_pos = torch.arange(seq_len)
            query_pos = torch.arange(context, seq_len)
            mask = (key_pos[None, :] <= query_pos[:, None]).to(device)
        n_blocks = _blocks_for(seq_len, block_size)
        token_index = torch.cat([torch.arange(starts[r], starts[r] + q_len) for r in rows])
        prefill.append(_PrefillGroup(
            token_index=token_index.to(device),
            block_ids=tables()[torch.tensor(rows), :n_blocks].reshape(-1).to(device),
            num_rows=len(rows), q_len=q_len, seq_len=seq_len, mask=mask,
        ))

    if num_blocks is not None and given.numel():
        lowest, highest = (int(x) for x in torch.aminmax(given))
        if not 0 <= lowest <= highest < num_blocks:
            raise ValueError(f"block_tables hold ids outside [0, {num_blocks}) (the cache has {num_blocks} blocks)")
    if use_kernel:
        in_table = given.to(dtype=torch.int32).contiguous()  # itself when it is already so
        if len(kernel_pieces) == 1:  # decode rows only: no pieces to join
            token_index, table_row, lengths = kernel_pieces[0]
            max_len = int(len_a[decode_a].max()) if decode_a.size else 1
        else:
            token_index, table_row, lengths = (torch.cat(parts) for parts in zip(*kernel_pieces, strict=True))
            max_len = int(lengths.max()) if lengths.numel() else 1
        kernel = _KernelRows(
            block_tables=in_table, token_index=token_index, table_row=table_row, seq_lens=lengths, max_len=max_len,
        )
        return _StepPlan(decode=[], prefill=prefill, all_tokens_decode_in_order=False, kernel_rows=kernel,
                         amx_prefill=amx_prefill,
                         amx_prefill_rows=amx_prefill_attention.prefill_rows(amx_prefill) if amx_prefill else None)

    decode: list[_DecodeBucket] = []
    decode_rows.sort(key=lambda r: seq_lens[r])
    i = 0
    while i < len(decode_rows):
        first_blocks = _blocks_for(seq_lens[decode_rows[i]], block_size)
        j = i + 1
        while j < len(decode_rows):
            row_blocks = _blocks_for(seq_lens[decode_rows[j]], block_size)
            if j - i >= _MIN_BUCKET_ROWS and row_blocks > first_blocks * _BUCKET_GROWTH:
                break
            j += 1
        if 0 < len(decode_rows) - j < _MIN_BUCKET_ROWS:  # do not leave a tiny last bucket
            j = len(decode_rows)
        rows = decode_rows[i:j]
        lens = torch.tensor([seq_lens[r] for r in rows])
        n_blocks = _blocks_for(int(lens.max()), block_size)
        length = n_blocks * block_size
        blocks = tables()[torch.tensor(rows), :n_blocks]  # [n, n_blocks]
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).reshape(len(rows), 1, length)
        # A lane past its row's length is masked (-inf below), but its key and value still go through
        # the GEMMs, and a slot nothing wrote (the KV cache is not zeroed) may hold NaN: NaN x 0 is NaN.
        # So such a lane reads the row's first slot, which the row's prefill wrote.
        past_end = (torch.arange(length) >= lens[:, None])[:, None, :]  # [n, 1, length]
        slots = torch.where(past_end, slots[:, :, :1], slots)
        cache_rows = slots * num_kv_heads + torch.arange(num_kv_heads)[None, :, None]  # [n, kv_heads, length]
        bias = torch.zeros(len(rows), 1, 1, length, dtype=dtype)
        bias.masked_fill_(torch.arange(length)[None, None, None, :] >= lens[:, None, None, None], float("-inf"))
        decode.append(
            _DecodeBucket(
                token_index=torch.tensor([starts[r] for r in rows]).to(device),
                cache_rows=cache_rows.reshape(-1).to(device),
                length=length,
                key_bias=bias.expand(len(rows), num_kv_heads, 1, length).reshape(-1, 1, length).to(device),
            )
        )
        i = j
    in_order = (
        not prefill
        and len(decode_rows) == meta.num_tokens
        and all(starts[r] == k for k, r in enumerate(decode_rows))
    )
    return _StepPlan(decode=decode, prefill=prefill, all_tokens_decode_in_order=in_order)
