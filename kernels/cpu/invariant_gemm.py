"""float32 GEMMs whose every output is one fused multiply-add chain in a fixed order: a row's result is
the same bits whatever else is in the call, however many rows, on however many threads.

Why: a batch-invariant engine (the `batch_invariant` setting, docs/engine.md "Batch invariance") needs
each token's projections and logits to depend on that token alone. MKL's F.linear changes its
summation order with the row count (a row alone and the same row among 63 others differ in the last
bits: tests/test_cpu_invariant_gemm.py shows it), and oneDNN's choice of kernel and of a split of K
over threads is its own heuristic, which no release promises to keep. Here the order is the
definition: y[m][n] = bias[n] + fma-chain over k = 0 .. K-1 of x[m][k] w[n][k], starting from 0, one
rounding per step, the bias added last. The threads split columns (panels of 16) and rows, never K;
K blocks (kept in cache) hand their partial sums on through memory, an exact round trip. So a row's
bits depend on neither the other rows, nor the row count, nor the thread count, nor the vector
width (each lane is one chain), and they equal a plain loop of fmaf (the self-check's reference).

Speed, measured on a 2-core AMD EPYC (AVX2, one thread, thread CPU time): at tiny-llama's and
SmolLM2's shapes (K 256-1,536, N 256-49,152, 4-2,048 rows) 0.7-1.0x the time of oneDNN's packed
float32 GEMM and of MKL's F.linear (docs/performance-log.md, "batch invariance"): a 6 x 16 register
tile fed by one broadcast per row and two weight loads per k, the weight packed once at load in
panels of 16 columns, rows in passes of ROW_PASS so the weight streams from memory once per pass.

The MLP's SiLU x mul can come with the down projection (linear_silu_mul): its exp is a fixed
sequence of float32 operations (Cephes' expf, within ~2 ulp), the same in every lane and in the
scalar tail, so an element's value never depends on where it sits (torch's own SiLU rounds the lanes
of its vector loop and its scalar tail differently, and its threads cut rows where the element count
says: a row then changes with the batch).

The kernel is csrc/invariant_gemm.c; available() is False where it cannot be built or fails its
self-check, and the engine then refuses `batch_invariant=on` (paths.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary

log = logging.getLogger(__name__)

# Rows per pass (a multiple of the kernel's 6-row tile): the weight streams through the cache once per
# pass. One pass holds a decode step's rows; at 48 rows the LM head (32 MB at tiny-llama's shape) was
# read 6 times for 256 rows and took 1.5x as long (measured with K blocks of 128 to 2,048 and passes of
# 24 to 264 rows: passes of 264 rows without K blocks were the fastest or within 5% everywhere).
ROW_PASS = 264
# The K block: the longest run of k a tile takes in one go (16 columns x K_BLOCK floats of weight stay
# in L2). Up to SmolLM2's 1,536 nothing is cut; larger K hands partial sums on through memory.
K_BLOCK = 4096
PANEL = 16  # columns per packed panel (csrc/invariant_gemm.c)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ig_pack_weight.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.ig_pack_weight.restype = None
    lib.ig_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr]
    lib.ig_gemm.restype = None
    lib.ig_silu_mul.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.ig_silu_mul.restype = None


_library = OnDemandLibrary("invariant_gemm.c", "batch-invariant CPU GEMM", _declare)
_lock = threading.Lock()
_ready: bool | None = None
_workspaces = threading.local()  # each thread's SiLU x mul rows (steps in parts run side by side)


class InvariantWeight:
    """A float32 weight [out, in] packed in panels of 16 columns for the fixed-order kernel."""

    __slots__ = ("n", "k", "packed")

    def __init__(self, weight: torch.Tensor):
        lib = _library.get()
        if lib is None:
            raise RuntimeError("the batch-invariant GEMM is not available (no C compiler, or its build failed)")
        w = weight.detach().float().contiguous()
        self.n, self.k = w.shape
        self.packed = torch.empty(-(-self.n // PANEL) * PANEL * self.k, dtype=torch.float32)
        lib.ig_pack_weight(w.data_ptr(), self.k, self.n, self.k, self.packed.data_ptr(), torch.get_num_threads())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, in] (rows may be strided) @ weight.T + bias, float32 [m, out]; into `out` when it is a
        contiguous float32 [m, out] tensor."""
        return self._gemm(x, bias, silu_mul=False, out=out)

    def linear_silu_mul(self, gate_up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(SiLU(gate) * up) @ weight.T + bias for gate_up = [gate | up] [m, 2 * in]: the MLP's down
        projection with its SiLU x mul (the fixed exp above) made in the same call."""
        return self._gemm(gate_up, bias, silu_mul=True)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
        width = 2 * self.k if silu_mul else self.k
        if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32 or x.stride(1) != 1:
            x = x.reshape(-1, width).float().contiguous()
        m = x.shape[0]
        if out is None or out.shape != (m, self.n) or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(m, self.n)
        if m == 0:
            return out
        if bias is not None:
            bias = bias.detach().float().contiguous()
        act = _activation_workspace(m * self.k) if silu_mul else None
        _library.get().ig_gemm(
            x.data_ptr(), x.stride(0), m, self.k, self.packed.data_ptr(), self.n,
            bias.data_ptr() if bias is not None else None, out.data_ptr(), self.n, K_BLOCK, ROW_PASS,
            torch.get_num_threads(), int(silu_mul), act.data_ptr() if act is not None else None,
        )
        return out


def _activation_workspace(elements: int) -> torch.Tensor:
    """This thread's buffer for SiLU(gate) * up, grown to at least `elements` (kept: every step needs it)."""
    buf = getattr(_workspaces, "act", None)
    if buf is None or buf.numel() < elements:
        buf = _workspaces.act = torch.empty(elements, dtype=torch.float32)
    return buf


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up = [gate | up] [m, 2k] with the kernel's fixed exp: float32 [m, k]."""
    lib = _library.get()
    if lib is None:
        raise RuntimeError("the batch-invariant GEMM is not available (no C compiler, or its build failed)")
    x = gate_up.float().contiguous()
    m, k = x.shape[0], x.shape[1] // 2
    out = torch.empty(m, k)
    if m:
        lib.ig_silu_mul(x.data_ptr(), x.stride(0), m, k, out.data_ptr(), torch.get_num_threads())
    return out


def fma_chain_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The definition, one libm fmaf call per step (fmaf rounds once, as the instruction does): for the
    self-check and the tests, small shapes only."""
    fmaf = _libm_fmaf()
    xs, ws = x.float().tolist(), weight.float().tolist()
    out = torch.empty(len(xs), len(ws), dtype=torch.float32)
    for i, row in enumerate(xs):
        for j, col in enumerate(ws):
            acc = 0.0
            for a, b in zip(row, col, strict=True):
                acc = fmaf(a, b, acc)
            out[i, j] = acc
    return out


def _libm_fmaf():
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    fmaf = libm.fmaf
    fmaf.argtypes = [ctypes.c_float, ctypes.c_float, ctypes.c_float]
    fmaf.restype = ctypes.c_float
    return fmaf


def _self_check() -> bool:
    """Awkward shapes (row and column tails, a bias) against the fma chain computed in float64, and a row
    alone against the same row among others: a kernel wrong on this CPU turns the path off."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((7, 40, 37), (13, 3, 16), (1, 70, 5)):
        weight = torch.randn(n, k, generator=gen)
        x = torch.randn(m, k, generator=gen)
        packed = InvariantWeight(weight)
        got = packed.linear(x)
        if not torch.equal(got, fma_chain_reference(x, weight)):
            return False
        if not torch.equal(packed.linear(x[2:3] if m > 2 else x[:1]), got[2:3] if m > 2 else got[:1]):
            return False
    return True


def available() -> bool:
    """True when the kernel builds here and passes its self-check (checked once per process)."""
    global _ready
    if _ready is not None:
        return _ready
    with _lock:
        if _ready is None:
            ready = False
            if _library.get() is None:
                log.info("the batch-invariant GEMM did not build: batch_invariant cannot be taken")
            else:
                with torch.inference_mode():
                    ready = _self_check()
                if not ready:
                    log.warning("the batch-invariant GEMM failed its self-check: batch_invariant cannot be taken")
            _ready = ready
        return _ready
