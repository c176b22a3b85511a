"""Apply a token bitmask to logits: disallowed token ids become -inf before sampling.

The bitmask is int32 [rows, ceil(V / 32)] in the layout llguidance fills: bit j of word w
allows token 32 * w + j (1 = allowed). Row i of the mask applies to logits row `rows[i]` (or
to row i when `rows` is None). Ids at or beyond 32 * words (a vocabulary padded past what the
mask covers) are disallowed too.

Three ways, one result:
- ``apply_token_bitmask_triton``: the CUDA fast path, one program per (row, block of words).
- ``apply_token_bitmask_cpu``: the CPU path. Grammar masks come in long runs (a JSON state allows
  a handful of tokens, or all but a handful), so it works per 32-token word: an all-zero word
  sets 32 logits to -inf in one slice write, an all-ones word is skipped, and only the few mixed
  words are unpacked bit by bit. On a 256 x 32000 batch of real JSON masks this is a few
  milliseconds, where a dense unpack + masked_fill costs tens.
- ``apply_token_bitmask_ref``: the plain-torch reference the others are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_INF = float("-inf")


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> int:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits must be [N, V] and the bitmask [K, ceil(V/32)]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, got {bitmask.dtype}")
    k = bitmask.shape[0] if rows is None else rows.numel()
    if rows is None and k != logits.shape[0]:
        raise ValueError(f"{k} mask rows for {logits.shape[0]} logits rows (pass rows=)")
    if k > bitmask.shape[0]:
        raise ValueError(f"{k} rows to mask but the bitmask has {bitmask.shape[0]}")
    return k


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (reference)."""
    k = _check(logits, bitmask, rows)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:k].unsqueeze(-1) >> shifts) & 1).reshape(k, -1)
    allowed = torch.zeros((k, vocab), dtype=torch.bool, device=logits.device)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].to(logits.device).bool()
    target_rows = torch.arange(k, device=logits.device) if rows is None else rows.to(logits.device)
    logits[target_rows] = logits[target_rows].masked_fill(~allowed, _NEG_INF)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place, on CPU tensors; the same result as the reference (see the module docstring)."""
    k = _check(logits, bitmask, rows)
    if k == 0:
        return
    vocab = logits.shape[1]
    mask = bitmask[:k]
    full_words = min(vocab // 32, mask.shape[1])
    target = logits if rows is None else logits[rows]  # a copy when rows are picked: written back
    if full_words:
        if not target.is_contiguous():
            raise ValueError("logits rows must be contiguous")
        words = torch.as_strided(target, (k, full_words, 32), (target.stride(0), 32, 1))
        head = mask[:, :full_words]
        # One broadcast add over the words: -inf for an all-zero word, 0 (exact) for the rest.
        words.add_(torch.zeros(head.shape, dtype=target.dtype).masked_fill_(head == 0, _NEG_INF).unsqueeze(-1))
        mixed = (head != 0) & (head != -1)
        if mixed.any():
            shifts = torch.arange(32, dtype=torch.int32)
            bits = (head[mixed].unsqueeze(1) >> shifts) & 1
            words[mixed] = words[mixed].masked_fill(bits == 0, _NEG_INF)
    tail = full_words * 32
    if tail < vocab:  # a last word partly past the vocabulary, and ids past the mask
        apply_token_bitmask_ref(target[:, tail:], _shift_words(mask, full_words, vocab - tail))
    if rows is not None:
        logits[rows] = target


def _shift_words(mask: torch.Tensor, first_word: int, width: int) -> torch.Tensor:
    """The mask words from `first_word` on, covering `width` ids (missing words: disallowed)."""
    need = (width + 31) // 32
    part = mask[:, first_word : first_word + need]
    if part.shape[1] < need:
        pad = torch.zeros((mask.shape[0], need - part.shape[1]), dtype=mask.dtype, device=mask.device)
        part = torch.cat([part, pad], dim=1)
    return part


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, mask_ptr, rows_ptr, stride_logits, stride_mask, vocab, mask_words,
    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    word_idx = offs // 32
    words = tl.load(mask_ptr + i * stride_mask + word_idx, mask=in_vocab & (word_idx < mask_words), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    row = i
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    ptrs = logits_ptr + row * stride_logits + offs
    tl.store(ptrs, tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place, with the Triton kernel (the CUDA path; the interpreter runs it on CPU tensors)."""
    k = _check(logits, bitmask, rows)
    if k == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    mask = bitmask.to(logits.device)
    vocab = logits.shape[1]
    block = 1024
    rows_arg = rows.to(logits.device, torch.int64) if rows is not None else mask  # unused without rows
    _token_bitmask_kernel[(k, triton.cdiv(vocab, block))](
        logits, mask, rows_arg, logits.stride(0), mask.stride(0), vocab, mask.shape[1],
        HAS_ROWS=rows is not None, BLOCK=block,
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: the path for the logits' device."""
    if logits.device.type == "cuda":
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_cpu(logits, bitmask, rows)
