"""A step's token bitmask on the CPU: its greedy rows' masked argmax without writing the mask, and the
mask written where rows need it whole, at a cost that does not grow with the grammar's mixed words.

The bitmask is llguidance's: int32 [K, W], bit j of word w allows token 32 w + j; ids at or past
32 W are disallowed (a vocabulary padded past what the mask covers). Row k of the mask is for row
`rows[k]` of the tensor it is applied to (row k when `rows` is None).

Why not kernels/token_bitmask.py's CPU pass alone: a JSON string's state allows nearly every token
but a few (quotes, backslashes, control characters), so nearly every 32-token word of its rows is
mixed, and that pass unpacks mixed words through boolean indexing of an [K, W, 32] view, about a
microsecond a word: 26 ms for one 256-row step of the structured bench on a 2-core EPYC, a quarter
of the whole step, where the plain step's argmax is 3 ms.

- masked_argmax: what apply + argmax gives (the lowest allowed id among each row's largest allowed
  logits), without the apply. Each masked row's plain argmax is taken first (the fast block-max
  argmax the sampler uses): where that id is allowed it is the answer, since no allowed id can beat
  the row's overall maximum and a tie goes to the lowest id either way. Only the rows whose argmax
  is disallowed (a state that allows a handful of tokens, or a string whose best token is a quote)
  are searched again, over their non-zero words alone.
- apply_bitmask: disallowed ids to -inf in place: all-zero words by one broadcast add, as the
  kernel's pass does, then the zero bits of mixed words by one flat index_fill over their positions
  (found with one nonzero over the mixed words' bits), not word by word.
"""

from __future__ import annotations

import torch

from tokenmill.engine.sampler import greedy_argmax

_NEG_INF = float("-inf")
# A row with more non-zero words than this, whose plain argmax is disallowed, has its words pruned by
# their plain maxima before any is unpacked (_prune).
HEAVY_ROW_WORDS = 64


def _bits(words: torch.Tensor) -> torch.Tensor:
    """int32 words [M] -> their bits [M, 32] (bit j of a word in column j)."""
    # The shifts are made here, not at import: torch reads its huge-page setting at its first CPU
    # allocation, which must come after the engine has set it (engine/cpu/host_memory.py).
    return (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1


def _target_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("logits must be [N, V] and the bitmask int32 [K, W]")
    k = logits.shape[0] if rows is None else rows.numel()
    if k > bitmask.shape[0]:
        raise ValueError(f"{k} rows to mask but the bitmask has {bitmask.shape[0]}")
    return torch.arange(k) if rows is None else rows.to(torch.long)


def _words(x: torch.Tensor, full: int) -> torch.Tensor:
    """The first `full` 32-id words of each row of x [N, V] (rows contiguous), as a view [N, full, 32]."""
    if x.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    return torch.as_strided(x, (x.shape[0], full, 32), (x.stride(0), 32, 1))


def _tail_bits(mask: torch.Tensor, full: int, count: int) -> torch.Tensor:
    """Bits [K, count] of the ids 32 full ... 32 full + count - 1 (inside word `full`)."""
    return (mask[:, full : full + 1] >> torch.arange(count, dtype=torch.int32)) & 1


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N]: each row's argmax after its mask row (rows without one: the plain argmax), the
    lowest id on ties, as greedy_argmax of the masked logits; `logits` are not written."""
    targets = _target_rows(logits, bitmask, rows)
    ids = greedy_argmax(logits)
    k = targets.numel()
    if k == 0:
        return ids
    mask = bitmask[:k]
    width = mask.shape[1]
    picked = ids[targets]
    word = mask.gather(1, (picked // 32).clamp(max=max(width - 1, 0)).unsqueeze(1)).squeeze(1)
    allowed = (picked < 32 * width) & (((word >> (picked % 32).to(torch.int32)) & 1) != 0)
    redo = (~allowed).nonzero().squeeze(1)
    if redo.numel():
        ids[targets[redo]] = _search_words(logits, targets[redo], mask[redo])
    return ids


def _search_words(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked argmax of logits rows `targets` [B] under mask rows [B, W], over their non-zero
    words only (and the last, partial word of a vocabulary that is not a multiple of 32): no pass
    over a whole row, since most rows here allow a handful of tokens."""
    b = targets.numel()
    covered = min(logits.shape[1], 32 * mask.shape[1])
    full, tail = divmod(covered, 32)
    head = mask[:, :full]
    r, c = head.nonzero(as_tuple=True)  # row-major: ascending (row, word)
    r, c = _prune(logits, targets, head, r, c)
    values = _words(logits, full)[targets[r], c].masked_fill_(_bits(head[r, c]) == 0, _NEG_INF)
    best = values.amax(dim=1)
    if tail:  # the partial last word as one more entry of each row, after its full words
        tail_values = logits[targets, 32 * full : covered].masked_fill(_tail_bits(mask, full, tail) == 0, _NEG_INF)
        tail_values = torch.cat([tail_values, tail_values.new_full((b, 32 - tail), _NEG_INF)], dim=1)
        order = torch.cat([r, torch.arange(b)]).argsort(stable=True)
        r = torch.cat([r, torch.arange(b)])[order]
        c = torch.cat([c, torch.full((b,), full)])[order]
        values = torch.cat([values, tail_values])[order]
        best = torch.cat([best, tail_values.amax(dim=1)])[order]
    if r.numel() == 0:
        return torch.zeros(b, dtype=torch.long)
    row_best = torch.full((b,), _NEG_INF, dtype=best.dtype).scatter_reduce_(0, r, best, "amax")
    # Each row's first entry (lowest word) holding its largest allowed logit.
    hits = (best == row_best[r]).nonzero().squeeze(1)
    first = torch.full((b,), r.numel(), dtype=torch.long).scatter_reduce_(0, r[hits], hits, "amin")
    found = (first < r.numel()) & (row_best > _NEG_INF)
    first = first.clamp(max=r.numel() - 1)
    # A row with nothing allowed (or only -inf logits) gets id 0, as the argmax of an all -inf row.
    return torch.where(found, c[first] * 32 + values[first].argmax(dim=1), torch.zeros_like(first))


def _prune(logits: torch.Tensor, targets: torch.Tensor, head: torch.Tensor, r: torch.Tensor,
           c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the words of rows with many non-zero words (a JSON string's state) that cannot hold the
    row's largest allowed logit: those whose plain maximum is below the best all-allowed word's
    (exact: every id of such a word is allowed), so a mixed word is unpacked only where it may win."""
    counts = torch.bincount(r, minlength=head.shape[0])
    heavy = (counts > HEAVY_ROW_WORDS).nonzero().squeeze(1)
    if heavy.numel() == 0:
        return r, c
    word_max = _words(logits, head.shape[1])[targets[heavy]].amax(dim=2)  # [H, words]
    floor = word_max.masked_fill(head[heavy] != -1, _NEG_INF).amax(dim=1, keepdim=True)
    below = torch.zeros(head.shape, dtype=torch.bool)
    below[heavy] = word_max < floor  # strictly: a word that ties may hold the lowest id
    keep = ~below[r, c]
    return r[keep], c[keep]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: the disallowed ids of the masked rows become -inf (any float dtype)."""
    targets = _target_rows(logits, bitmask, rows)
    k = targets.numel()
    if k == 0:
        return
    vocab = logits.shape[1]
    mask = bitmask[:k]
    target = logits if rows is None else logits[targets]  # a copy when rows are picked: written back
    covered = min(vocab, 32 * mask.shape[1])
    full, tail = divmod(covered, 32)
    if full:
        head = mask[:, :full]
        words = _words(target, full)
        words.add_(torch.zeros(head.shape, dtype=target.dtype).masked_fill_(head == 0, _NEG_INF).unsqueeze(-1))
        r, c = ((head != 0) & (head != -1)).nonzero(as_tuple=True)
        if r.numel():
            words[r, c] = words[r, c].masked_fill_(_bits(head[r, c]) == 0, _NEG_INF)
    if tail:
        target[:, 32 * full : covered].masked_fill_(_tail_bits(mask, full, tail) == 0, _NEG_INF)
    if covered < vocab:  # ids past what the mask covers
        target[:, covered:] = _NEG_INF
    if rows is not None:
        logits[targets] = target
