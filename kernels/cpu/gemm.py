"""float32 CPU GEMMs through oneDNN, with the weight packed once at load: the LM head always, the
layers' projections where oneDNN is the faster of the two (models with hidden_size >= 512).

Why: the LM head is the largest GEMM of a decode step, and at decode sizes (tens of rows) torch's
default GEMM (MKL through F.linear) neither reaches the core's speed nor splits over threads:
tiny-llama's [122 x 256] x [256 x 32000] takes 29.3 ms on one thread; oneDNN's matmul on the weight
reordered once into its blocked layout takes 19.4 (SmolLM2's [33 x 576] x [576 x 49152]: 38 -> 20.6
ms on one thread, 29 -> 12.6 on two). vLLM's CPU backend takes the same road for all its GEMMs.

The layers' projections, by shape. At tiny-llama's (hidden 256, intermediate 688) oneDNN gained
nothing once padded to a few row counts (the whole `mixed` run on one thread: 1,478 tok/s with them
on oneDNN, 1,576 with the LM head alone; 0.92-1.18x per GEMM, slower at 2 threads from 700 rows),
and one of 256 `mixed` sequences left transformers' greedy path at a logit tie of 2e-7 (1.2332990
against 1.2332988); so small models keep MKL's F.linear, the same bits as transformers' own. At
SmolLM2's (hidden 576, intermediate 1536) oneDNN, padded, is 1.09-1.25x MKL on one thread and
1.06-1.32x on two at 37-2,048 rows, and the layers' GEMMs are two thirds of its step: from a hidden
size of 512 (LAYERS_MIN_HIDDEN) the projections go to oneDNN too. This is also vLLM's CPU path.
On a CPU with AMX tiles every model's projections go instead to the split-bfloat16 kernel of
amx_gemm.py (float32's accuracy, faster than both); paths.CpuPaths.layer_gemm() decides.

A row's logits are the same bits at any row count and any thread count (MKL's F.linear changes its
summation order with the row count), and within float32 rounding of F.linear (tests/test_cpu_gemm.py).

oneDNN builds (JIT-compiles) and keeps code for every input shape it meets, about 0.65 MB each and
never freed, and the LM head meets every row count up to the batch size: in a soak of 20,000 jobs a
worker with every GEMM on oneDNN, unpadded, grew by 40%. So a GEMM runs at one of 32 row counts (_padded_rows): up to 256 rows it is
padded to the next of them (the padding rows, computed and dropped, are at most 3 rows or an
eighth), more rows go in pieces of 256. About 21 MB at most, and then no growth.

Off with the engine's `onednn_linear` setting (then the LM head's MKL path and F.linear everywhere),
or where torch has no oneDNN; its `onednn_layers` setting forces the layers' choice either way
(paths.py).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import amx_gemm, invariant_gemm

log = logging.getLogger(__name__)

# The smallest hidden size whose layer projections run on oneDNN (see the module docstring).
LAYERS_MIN_HIDDEN = 512

# The row count oneDNN picks the packed layout for. It is a layout choice, not a limit: any row
# count runs on it and gives the same bits (the hint only changes speed). 256 was as fast as the
# best hint from 1 to 2,048 rows on the shapes measured; a hint of 1 picks a GEMV layout whose
# one-row results differ from the others.
PACK_ROWS_HINT = 256

_lock = threading.Lock()
_available: bool | None = None


def _self_check() -> bool:
    """Pack a small weight and compare one product with F.linear: an op that is missing, or wrong on
    this CPU, turns the fast path off instead of serving wrong logits."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    with torch.inference_mode():
        got = _matmul(x, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), bias)
        want = F.linear(x, weight, bias)
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


def available() -> bool:
    """True when float32 CPU weights can be packed for oneDNN (checked once per process)."""
    global _available
    if _available is not None:  # settled: asked at every pack, so no lock then
        return _available
    with _lock:
        if _available is None:
            try:
                _available = bool(torch.backends.mkldnn.is_available()) and _self_check()
            except (RuntimeError, AttributeError, NotImplementedError) as exc:
                log.info("oneDNN linear unavailable (%s): CPU linear layers use F.linear", exc)
                _available = False
        return _available


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a float32 CPU weight [out, in], or None where the fast path does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not available():
        return None
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


class PackedWeight:
    """A float32 CPU weight and its copy for oneDNN, the AMX kernel or the batch-invariant kernel
    (invariant_gemm.py), made again when the weight is written in place (a reload)."""

    __slots__ = ("weight", "kind", "_key", "_packed")

    def __init__(self, weight: torch.Tensor, kind: str = "onednn", packed: torch.Tensor | None = None):
        """packed: the oneDNN copy of `weight` as it is now, made before (e.g. read back from a file by
        onednn_bytes.from_bytes); without it the copy is made on first use."""
        if kind not in ("onednn", "amx", "invariant"):
            raise ValueError(f"unknown packed GEMM kind {kind!r}")
        self.weight = weight
        self.kind = kind
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | amx_gemm.SplitWeight | invariant_gemm.InvariantWeight | None = None
        if packed is not None:
            if kind != "onednn" or tuple(packed.shape) != tuple(weight.shape):
                raise ValueError(f"a {kind} weight of shape {tuple(weight.shape)} cannot take a packed "
                                 f"oneDNN weight of shape {tuple(packed.shape)}")
            self._packed, self._key = packed, (weight.data_ptr(), weight._version)

    def packed(self) -> torch.Tensor | amx_gemm.SplitWeight | invariant_gemm.InvariantWeight | None:
        key = (self.weight.data_ptr(), self.weight._version)
        if key != self._key:
            build = {"amx": amx_gemm.SplitWeight, "invariant": invariant_gemm.InvariantWeight}.get(self.kind, pack)
            self._packed, self._key = build(self.weight), key
        return self._packed

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed()
        if isinstance(packed, amx_gemm.SplitWeight | invariant_gemm.InvariantWeight):
            return packed.linear(x, bias)
        return linear(x, self.weight, bias, packed)

    @property
    def folds_silu_mul(self) -> bool:
        """The kernel takes the MLP's SiLU x mul with the down projection (linear_silu_mul)."""
        return self.kind in ("amx", "invariant")


def _matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Rows per GEMM call: more are computed in pieces of this many (see _padded_rows).
MAX_ROWS = 256


def _padded_rows(rows: int) -> int:
    """The row count a GEMM of 1 <= `rows` <= MAX_ROWS rows runs at: a multiple of 4 up to 64, then
    eight sizes per doubling; 32 sizes in all, so at most 3 rows or 12.5% are padding."""
    step = max(4, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def row_counts() -> list[int]:
    """Every row count a GEMM call of 1 to MAX_ROWS rows runs at (_padded_rows), largest first."""
    return sorted({_padded_rows(rows) for rows in range(1, MAX_ROWS + 1)}, reverse=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: on the packed weight when there is one, else F.linear."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows > MAX_ROWS:  # pieces of MAX_ROWS rows are as fast per row, and keep the shapes few
        pieces = [_padded_matmul(x[i : i + MAX_ROWS], packed, bias) for i in range(0, rows, MAX_ROWS)]
        return torch.cat(pieces)
    return _padded_matmul(x, packed, bias)


def _padded_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = _padded_rows(rows) if rows else 0
    if padded == rows:
        return _matmul(x, packed, bias)
    # Each row is computed on its own (a row's bits do not depend on the others), so zero rows
    # appended and dropped change nothing of the real ones.
    grown = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return _matmul(grown, packed, bias)[:rows]
