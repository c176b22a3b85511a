"""Greedy rows on the CPU without the full float32 LM head: a bfloat16 screen, float32 for the few
candidates, and the same token as the full head.

Why: the LM head is the largest GEMM of a decode step (28% of a one-thread tiny-llama step), and a
plain greedy row reads one number out of it, the argmax. With avx512_bf16, oneDNN's bfloat16 GEMM
runs at about twice the float32 rate, but its logits are rounded: taken as they are, they would pick
another token whenever two logits are close. So the bfloat16 logits only screen.

How, for one row with hidden state h (float32) and LM-head rows w_j:

1. screen_j = h . w_j with h and w rounded to bfloat16, float32 accumulation, bfloat16 result (oneDNN,
   on a bfloat16 copy of the weight packed once at load).
2. A bound that holds for every j: |screen_j - logit_j| <= eps_j, where logit_j is the full float32
   head's logit (any summation order). With h_b and w_b the bfloat16 roundings of h and w_j (u =
   2^-8, gamma_K = K 2^-24 / (1 - K 2^-24), magnitudes summed by Cauchy-Schwarz):
   - h_b . w_b - h . w = (h_b - h) . w_b + h . (w_b - w): at most |h - h_b| |w_b| + |h| |w_j - w_b|;
   - the bfloat16 GEMM's float32 sum of the exact products h_b,k w_b,k: gamma_K |h_b| |w_b|;
   - the full head's own float32 sum: gamma_K |h| |w_j|;
   - the screen's rounding to bfloat16: u / (1 - u) |screen_j|;
   - K 2^-126 (|h| + max |w| + 1) for the denormals that the bfloat16 instructions flush to zero.
   The row's norms are computed per row, the columns' once at load, in float64: the actual rounding
   residuals are about 0.4 u of each norm, and a head's rows differ in norm (SmolLM2's from 1.8 to
   7.5), so this is some fifty times tighter than one C_K |h| max |w| for all.
3. The best logit is at least screen_m - eps_m (m: the screen's own argmax), so every j whose logit
   can be the maximum has screen_j + eps_j >= screen_m - eps_m. Those candidates, a few per row (4-6
   on SmolLM2's trained head, median), get their float32 logit computed in C the way oneDNN's float32
   kernel computes it (fused multiply-adds in order within each of its K blocks, the block found at
   load), so each is the full head's logit bit for bit (tested), and the row's token is their argmax,
   the lowest id on ties, as torch.argmax.

A row whose hidden state or screen is not finite, or that keeps more than MAX_CANDIDATES candidates,
sends its step to the full head; a screen that does so in more than a quarter of its first steps (a
trained head whose bound is too loose to narrow it) turns itself off. Only greedy rows without
logprobs come here (the caller checks); they need the argmax only. A row under a constraint's token
mask has its disallowed ids skipped by the C kernel: never the screen's maximum, never candidates.
A row with penalties or a min_tokens block has those few positions held out of the screen: their
exact float32 logits are computed and edited as the sampler edits them, and compared with the
screen's best.
Off with the engine's `greedy_screen` setting (paths.py), and wherever oneDNN has no bfloat16 GEMM or
the C kernel (csrc/greedy_screen.c) cannot be built: then every row takes the full head.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.cpu import gemm
from tokenmill.kernels.cpu.build import OnDemandLibrary

if TYPE_CHECKING:
    from tokenmill.engine.sampler import LogitEdits

# A constraint for the screen's rows: given the row count N, (int32 bitmask [K, W] in llguidance's
# layout: bit j of word w allows id 32 w + j, ids past 32 W disallowed; int64 [N]: each row's row of
# the bitmask, -1 for a row without a constraint).
AllowedIds = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    lib.greedy_from_screen.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr, f64, f64, f64, f64, f64, f64,
                                       i64, i64, ptr, ptr, ptr, i64, ptr, ptr]
    lib.hold_out.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.hold_out.restype = None
    lib.edited_may_win.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, f64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.edited_may_win.restype = i64
    lib.greedy_from_screen.restype = None
    lib.logits_at.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.logits_at.restype = None
    lib.column_norms.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64]
    lib.column_norms.restype = None


_library = OnDemandLibrary("greedy_screen.c", "greedy LM-head screen", _declare)


def available() -> bool:
    """True where a screen can be built here: oneDNN's bfloat16 GEMM and the C kernel (checked once)."""
    return bf16_gemm_supported() and _library.get() is not None


def bf16_gemm_supported() -> bool:
    """oneDNN has a bfloat16 GEMM on this CPU (without one torch would emulate it, slower than fp32)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


U_BF16 = 2.0**-8  # bfloat16's unit roundoff


def gamma(k: int) -> float:
    """gamma_K: a float32 sum of k terms, in any order, is within gamma_K of the sum of their magnitudes."""
    return k * 2.0**-24 / (1.0 - k * 2.0**-24)


def column_norms(lib: ctypes.CDLL, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 [V] each: |w_j|, |bf16(w_j)| and |w_j - bf16(w_j)| of the rows of a finite float32
    weight [V, K] (contiguous), in one C pass (csrc/greedy_screen.c: column_norms)."""
    vocab, hidden = weight.shape
    sq = [torch.empty(vocab, dtype=torch.float64) for _ in range(3)]
    lib.column_norms(weight.data_ptr(), vocab, hidden, *(t.data_ptr() for t in sq), torch.get_num_threads())
    return tuple(t.sqrt_() for t in sq)


def _rounded_up(x: torch.Tensor) -> torch.Tensor:
    """float64 x as float32, rounded up (never below x)."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.tensor(float("inf"))), f)


# oneDNN's K blocks tried at load, largest first: its float32 kernel sums K in blocks (all of K=256,
# 512 of K=576, 1024 of K=2048 measured), the block a heuristic of the shape.
_K_BLOCKS = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
_PROBE_ROWS = 8
_PROBE_COLS = 4096

# A row with more candidates than this goes to the full head: their float32 logits would cost more
# than the screen saves. Random-weight heads give 5-12 per row; a trained head whose logits crowd
# near the maximum, or whose weight rows differ much in norm (SmolLM2: 1.8 to 7.5), gives hundreds.
MAX_CANDIDATES = 64
# After this many calls, a screen that sent more than a quarter of them to the full head turns
# itself off for good (each such call paid the bfloat16 GEMM for nothing).
_JUDGE_AFTER = 16


class GreedyScreen:
    """The bfloat16 screen of one float32 CPU LM head [vocab, hidden]; see the module docstring."""

    def __init__(self, weight: torch.Tensor, packed_bf16: torch.Tensor, k_block: int, lib: ctypes.CDLL):
        self.weight = weight  # float32 [V, K], contiguous: the candidates' logits are computed from it
        self.packed = packed_bf16
        self.k_block = k_block
        self._lib = lib
        self.vocab, self.hidden = weight.shape
        # The columns' parts of the bound (module docstring), in float64, stored rounded up.
        norms, bf16_norms, rest_norms = column_norms(lib, weight)
        self.gamma = gamma(self.hidden)
        self.col_bf16_norm = _rounded_up(bf16_norms).contiguous()
        self.col_rest = _rounded_up(rest_norms + self.gamma * norms).contiguous()
        self.col_bf16_norm_max = float(self.col_bf16_norm.max())
        self.col_rest_max = float(self.col_rest.max())
        self.w_max = float(norms.max())
        self.d_rel = U_BF16 / (1.0 - U_BF16)
        self.abs_term = self.hidden * 2.0**-126
        self.last_candidates = 0  # candidates computed in float32 by the last call (stats, tests)
        self.calls = 0
        self.fallbacks = 0  # calls that sent their rows to the full head
        self.enabled = True

    @classmethod
    def build(cls, weight: torch.Tensor, packed_f32: torch.Tensor | None,
              full_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GreedyScreen | None:
        """The screen of the head `weight` whose full float32 GEMM runs on `packed_f32` (gemm.pack), or
        is `full_head` (x -> logits: the batch-invariant head, invariant_gemm.py, one K block of all K),
        or None where it does not apply (see the module docstring). The caller asks only where the
        engine takes this path (paths.CpuPaths.greedy_screen)."""
        if ((packed_f32 is None and full_head is None) or weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.dim() != 2 or not bf16_gemm_supported()):
            return None
        lib = _library.get()
        if lib is None:
            return None
        with torch.inference_mode():
            weight = weight.detach().contiguous()
            if not bool(torch.isfinite(weight).all()):
                return None
            k_block = _find_k_block(lib, weight, full_head or (lambda x: gemm.linear(x, weight, None, packed_f32)))
            if k_block is None:
                log.info("greedy screen off: no K blocking reproduces this LM head's float32 logits")
                return None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), gemm.PACK_ROWS_HINT)
            _warm_every_row_count(weight, packed)
        return cls(weight, packed, k_block, lib)

    def greedy_ids(self, hidden: torch.Tensor, allowed: AllowedIds | None = None,
                   edits: LogitEdits | None = None) -> torch.Tensor | None:
        """int64 [N]: the argmax of hidden [N, K] @ weight.T that the full float32 head gives; None when
        a row is not finite (the caller takes the full head). `allowed` (a structured-output
        constraint: allowed(N) gives its bitmask and each row's row of it, see AllowedIds) restricts a
        row to its allowed ids in the C kernel, nothing written: the screen's maximum is the best
        allowed one, no disallowed id is a candidate, and the token is the full head's argmax over the
        allowed ids. `edits` (penalties, min_tokens: the sampler's LogitEdits) change a few positions
        of the logits before the argmax: see _with_edits."""
        if not self.enabled:
            return None
        hidden = hidden.float().contiguous()
        n = hidden.shape[0]
        ids = torch.empty(n, dtype=torch.int64)
        if n == 0:
            return ids
        screen = gemm.linear(hidden.to(torch.bfloat16), self.weight, None, self.packed).contiguous()
        bitmask = allow_row = None
        if allowed is not None:
            bitmask, allow_row = allowed(n)
            bitmask, allow_row = bitmask.contiguous(), allow_row.to(torch.int64).contiguous()
            if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or allow_row.shape != (n,):
                raise ValueError("allowed(n) must give an int32 bitmask [K, W] and int64 rows [n]")
        held_out = None
        if edits is not None:
            held_out = self._hold_out(screen, edits, bitmask, allow_row)
        terms = torch.empty(n, 3, dtype=torch.float64) if held_out is not None else None
        cand = torch.empty(n, dtype=torch.int64)
        self._lib.greedy_from_screen(
            screen.data_ptr(), screen.stride(0), hidden.data_ptr(), hidden.stride(0),
            self.weight.data_ptr(), self.vocab, self.hidden, self.k_block, self.col_bf16_norm.data_ptr(),
            self.col_rest.data_ptr(), self.col_bf16_norm_max, self.col_rest_max, self.gamma,
            self.d_rel, self.abs_term, self.w_max, MAX_CANDIDATES, n, ids.data_ptr(), cand.data_ptr(),
            None if bitmask is None else bitmask.data_ptr(), 0 if bitmask is None else bitmask.shape[1],
            None if allow_row is None else allow_row.data_ptr(), None if terms is None else terms.data_ptr(),
        )
        self.calls += 1
        if bool((cand < 0).any()):
            self.fallbacks += 1
            if self.calls >= _JUDGE_AFTER and 4 * self.fallbacks > self.calls:
                self.enabled = False
                log.info("greedy screen off for this LM head: %d of %d steps had rows it could not narrow",
                         self.fallbacks, self.calls)
            return None
        self.last_candidates = int(cand.sum())
        if edits is not None and edits.penalised is not None:
            return self._with_edits(hidden, ids, edits, held_out, terms)
        return ids

    def _with_edits(self, hidden: torch.Tensor, ids: torch.Tensor, edits: LogitEdits,
                    held_out: tuple[torch.Tensor | None, torch.Tensor], terms: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax after the penalties, from `ids`, the full head's argmax over the row's
        positions that no edit touches (the screen held the edited ones at -inf), and `held_out`:
        per penalised position, whether it is allowed (None: all are) and its screen value.

        A penalised position can only win where its value after the penalties can reach the
        untouched best's exact logit: the bound of the module docstring on its raw logit, through
        the penalties (increasing in the raw logit), rules most out (edited_may_win, in C). The rest
        have their logits computed exactly (logits_at: the full head's bits), then penalised as the
        sampler does (the same elementwise float32 operations on the same raw logits); the token is
        the larger of their best and the untouched best, the lower id on a tie, which is
        torch.argmax's answer over the whole edited row. None (the full head) when an exact logit
        is not finite."""
        allowed, screen_values = held_out
        n = ids.numel()
        best_raw = self._logits_at(hidden, torch.arange(n), ids)
        if not bool(torch.isfinite(best_raw).all()):
            return None
        pos = edits.penalised
        keep = torch.empty(pos.numel(), dtype=torch.int64)
        kept = self._lib.edited_may_win(
            pos.data_ptr(), pos.numel(), self.vocab, screen_values.data_ptr(), self.col_bf16_norm.data_ptr(),
            self.col_rest.data_ptr(), terms.data_ptr(), self.d_rel, edits.rep.data_ptr(), edits.freq.data_ptr(),
            edits.pres.data_ptr(), edits.counts.data_ptr(), best_raw.data_ptr(),
            None if allowed is None else allowed.data_ptr(), keep.data_ptr())
        if kept == 0:
            return ids
        keep = keep[:kept]
        pos = pos[keep]
        rows, cols = pos // self.vocab, pos % self.vocab
        raw = self._logits_at(hidden, rows, cols)
        if not bool(torch.isfinite(raw).all()):
            return None
        values = edits.subset(keep).penalised_values(raw)
        best = torch.full((n,), float("-inf")).scatter_reduce(0, rows, values, "amax")
        at_best = values == best[rows]
        best_id = torch.full((n,), self.vocab, dtype=torch.int64).scatter_reduce(0, rows[at_best], cols[at_best], "amin")
        edited_wins = (best > best_raw) | ((best == best_raw) & (best_id < ids))
        return torch.where(edited_wins, best_id, ids)

    def _hold_out(self, screen: torch.Tensor, edits: LogitEdits, bitmask: torch.Tensor | None,
                  allow_row: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Takes every position an edit touches out of the screen (-inf there), so that the screen
        finds the best of the rest; returns, per penalised position, whether it is allowed (by the
        constraint's bitmask where its row has one, and not blocked by min_tokens; None where all
        are) and its screen value, or None where no position is penalised."""
        if edits.blocked is not None:
            screen.view(-1)[edits.blocked] = float("-inf")
        pos = edits.penalised
        if pos is None:
            return None
        allowed = None
        if bitmask is not None:
            rows, cols = pos // edits.vocab, pos % edits.vocab
            which = allow_row[rows]
            words = cols // 32
            word = bitmask[which.clamp(min=0), words.clamp(max=bitmask.shape[1] - 1)]
            bit = ((word >> (cols % 32).to(torch.int32)) & 1) != 0
            allowed = (which < 0) | ((words < bitmask.shape[1]) & bit)
        if edits.blocked is not None:
            blocked = torch.isin(pos, edits.blocked)
            allowed = ~blocked if allowed is None else allowed & ~blocked
        values = torch.empty(pos.numel())
        self._lib.hold_out(screen.data_ptr(), screen.stride(0), self.vocab, pos.data_ptr(), pos.numel(), values.data_ptr())
        return None if allowed is None else allowed.to(torch.uint8).contiguous(), values

    def _logits_at(self, hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float32 [P]: the full head's logits of (hidden row, weight row) pairs, bit for bit."""
        rows, cols = rows.contiguous(), cols.contiguous()
        out = torch.empty(rows.numel())
        self._lib.logits_at(hidden.data_ptr(), hidden.stride(0), self.weight.data_ptr(), self.hidden, self.k_block,
                            rows.data_ptr(), cols.data_ptr(), rows.numel(), out.data_ptr())
        return out

    def bound(self, hidden: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
        """float64 [N, V]: the eps_j of every row and column, as greedy_from_screen takes it (tests)."""
        h = hidden.double()
        h_b = hidden.to(torch.bfloat16).double()
        norm = torch.linalg.vector_norm(h, dim=1, keepdim=True)
        a = torch.linalg.vector_norm(h - h_b, dim=1, keepdim=True) + self.gamma * torch.linalg.vector_norm(h_b, dim=1, keepdim=True)
        return (a * self.col_bf16_norm.double() + norm * self.col_rest.double() + self.d_rel * screen.double().abs()
                + self.abs_term * (norm + self.w_max + 1.0))


def _warm_every_row_count(weight: torch.Tensor, packed_bf16: torch.Tensor) -> None:
    """The screen's GEMM once at each row count a step can give it (gemm.row_counts), at load.

    Why: oneDNN builds its kernel for a bfloat16 product the first time it meets a row count, and
    that first call maps fresh memory. A batch that grows through the 32 counts paid 8-12k page
    faults for it in the first batch after start, only: 0.2-0.5 s of a 2-thread tiny-llama `mixed`
    run, where both threads wait on the kernel's page-table work, and little of a 1-thread run, so
    it showed as worse scaling. All 32 at tiny-llama's head take about 45 ms, once per model."""
    x = torch.zeros(gemm.MAX_ROWS, weight.shape[1], dtype=torch.bfloat16)
    for rows in gemm.row_counts():
        gemm.linear(x[:rows], weight, None, packed_bf16)


def _find_k_block(lib: ctypes.CDLL, weight: torch.Tensor, full_head: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """The K block with which the C logit is the full head's bit for bit on probe rows (at two row
    counts, since oneDNN could block differently by the batch), or None."""
    vocab, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(_PROBE_ROWS, k, generator=gen)
    cols = torch.randint(0, vocab, (_PROBE_COLS,), generator=gen)
    rows = torch.arange(_PROBE_COLS) % _PROBE_ROWS
    full = full_head(probe)
    full_many = full_head(probe.repeat(gemm.MAX_ROWS // _PROBE_ROWS, 1))
    if not torch.equal(full, full_many[:_PROBE_ROWS]):
        return None
    want = full[rows, cols].contiguous()
    got = torch.empty(_PROBE_COLS)
    for kb in (k, *(b for b in _K_BLOCKS if b < k)):
        lib.logits_at(probe.data_ptr(), probe.stride(0), weight.data_ptr(), k, kb, rows.data_ptr(),
                      cols.data_ptr(), _PROBE_COLS, got.data_ptr())
        if torch.equal(got, want):
            return kb
    return None
