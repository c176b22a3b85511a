"""float32 GEMMs on the CPU's AMX tiles, each operand split exactly into three bfloat16 parts.

Why: on a CPU with AMX (Intel Xeon from Sapphire Rapids on) one core multiplies bfloat16 tiles at
about 1,024 flop per cycle, against 64 for float32 FMA in AVX-512: oneDNN's float32 GEMM peaks here
at 165-180 GFLOP/s on one core, its bfloat16 GEMM at 1.0-1.5 TFLOP/s. The layers' projections are
two thirds of a SmolLM2 step, all float32.

How, without leaving float32's accuracy: a float32 x is the exact sum x1 + x2 + x3 of three
bfloat16 numbers (x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2; 8 + 8 + 8 significant bits
cover float32's 24). So x . w = sum over i, j of xi . wj. The kernel keeps the six products with
i + j <= 4 and drops x2.w3, x3.w2, x3.w3, each below 2^-24 |x||w|, under float32's own rounding of
one product. Every bfloat16 product is exact in float32 and the tiles accumulate in float32, so a
logit's error is that of a float32 GEMM with another summation order: measured against float64,
the largest error relative to sum |x||w| is 1.0-2.0e-7 here, against 1.4-4.2e-7 for oneDNN's
float32 GEMM (tests/test_cpu_amx_gemm.py holds it under a bound). Six tile products per float32
product still leave about 2.6x float32's peak; measured per GEMM at SmolLM2's shapes, 1.4-1.9x
oneDNN's float32 (docs/engine.md).

Layout: the weight is split and packed once, at load, into the tiles' VNNI order (a 16 x 32 tile of
the three parts per 32 columns and 32 inputs); the activations are split per call, 32 rows at a
time, into the same blocks. One output block is 32 x 32 (four accumulator tiles, two A and two B
tiles). Threads split the columns, so a thread's weight stays in its own L2; inputs longer than
about 640 KB of split rows run in K slabs, the accumulators kept in a float32 workspace between
slabs (an exact round trip), so a row's bits do not depend on the slab, the row count, the other
rows or the thread count.

Where it applies: a float32 CPU weight, a CPU with amx_bf16, amx_tile and avx512_bf16 whose kernel
grants the tile state (arch_prctl), a C compiler that knows the AMX intrinsics (GCC 11, clang 12),
and a self-check against float64 at first use. Elsewhere available() is False and callers keep
oneDNN / MKL; the engine's `amx_gemm` setting turns it off (paths.py).

The kernel is csrc/amx_gemm.c, on the tiles' helpers of csrc/amx_tiles.h (shared with the prefill
attention kernel).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import NamedTuple

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary

log = logging.getLogger(__name__)

# Row blocks (of 32 rows) per pass of one thread: the split rows of a pass (rows x K x 6 bytes) stay
# in the core's L2 while every column pair reads them.
PASS_BLOCKS = 8
# Bytes of split rows per K slab: a pass over longer inputs (SmolLM2's down projection, K = 1,536)
# runs in slabs of at most this many, with the partial sums kept between slabs.
SLAB_BYTES = 640 * 1024
# The largest error of a self-check product against float64, relative to sum |x||w|: 4x what the
# split leaves (1-2e-7 measured), still below what oneDNN's float32 GEMM shows on the same data.
SELF_CHECK_BOUND = 8e-7
# How the threads share a call (amx_gemm), measured on 2 threads over a model's worth of weights in
# turn (so that each weight comes from L3, as in a step):
# - up to COLUMN_MAJOR_BLOCKS blocks of 32 rows, column-major, each thread splitting all rows itself:
#   it reads a share of the weight instead of all of it;
# - up to SHARED_SPLIT_BLOCKS, for a weight of at least SHARED_SPLIT_MIN_WEIGHT_BYTES (split, three
#   quarters of a 4 MiB L2), column-major with the rows split once between the threads: SmolLM2's
#   projections at 96-160 rows 0.99-1.18x row-major (gate/up and down 1.03-1.18x); tiny-llama's
#   weights (at most 2.1 MB split) 0.8-0.95x, so they stay row-major;
# - else row-major.
COLUMN_MAJOR_BLOCKS = 2
SHARED_SPLIT_BLOCKS = 5
SHARED_SPLIT_MIN_WEIGHT_BYTES = 3 << 20


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_request_permission.argtypes = []
    lib.amx_request_permission.restype = ctypes.c_int
    lib.amx_pack_weight.argtypes = [ptr, i64, i64, i64, i64, ptr, i64]
    lib.amx_pack_weight.restype = None
    lib.amx_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.amx_gemm.restype = None


_library = OnDemandLibrary("amx_gemm.c", "AMX split-bfloat16 GEMM", _declare)
_lock = threading.Lock()
_ready: bool | None = None
_self_checking = False  # set while available() runs the self-check (under _lock)
_workspaces = threading.local()  # each thread's split rows and partial sums (steps in parts run side by side)

_NEEDED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in _NEEDED_FLAGS)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SplitWeight:
    """A float32 weight [out, in] split into three bfloat16 parts and packed for the tiles."""

    __slots__ = ("n", "k", "n_pad", "k_pad", "packed")

    def __init__(self, weight: torch.Tensor):
        # available() also asks the kernel for the tile state: without it the first tile
        # instruction kills the process (SIGILL).
        lib = _library.get() if _ready or _self_checking or available() else None
        if lib is None:
            raise RuntimeError("the AMX GEMM is not available on this machine (amx_gemm.available())")
        self.n, self.k = weight.shape
        self.n_pad, self.k_pad = _round_up(self.n, 32), _round_up(self.k, 32)
        w = weight.detach().contiguous()
        self.packed = torch.empty(self.n_pad * self.k_pad * 3, dtype=torch.int16)
        lib.amx_pack_weight(w.data_ptr(), self.n, self.k, self.n_pad, self.k_pad, self.packed.data_ptr(),
                            torch.get_num_threads())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, in] (rows may be strided) @ weight.T + bias, float32 [m, out]."""
        return self._gemm(x, bias, silu_mul=False)

    def linear_silu_mul(self, gate_up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(SiLU(gate) * up) @ weight.T + bias for gate_up = [gate | up] [m, 2 * in]: the MLP's down
        projection with layers.silu_and_mul folded into the split of its rows, so the product of the
        two never goes to memory (one pass over [m, 2 * in] instead of three)."""
        return self._gemm(gate_up, bias, silu_mul=True)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
        width = 2 * self.k if silu_mul else self.k
        if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32 or x.stride(1) != 1:
            x = x.reshape(-1, width).float().contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n)
        if m == 0:
            return y
        if bias is not None:
            bias = bias.detach().float().contiguous()
        threads = torch.get_num_threads()
        plan = self.plan(m, threads)
        split_ws, acc_ws = workspace(plan.split_elems, plan.acc_elems)
        _library.get().amx_gemm(
            x.data_ptr(), x.stride(0), m, self.k, self.packed.data_ptr(), self.n, self.n_pad, self.k_pad,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), split_ws.data_ptr(), acc_ws.data_ptr(),
            plan.pass_blocks, plan.slab_blocks, threads, plan.col_major, plan.shared_split, silu_mul,
        )
        return y

    def plan(self, m: int, threads: int) -> GemmPlan:
        """How `threads` threads share a call of m rows, and the workspaces it needs (the kernel's
        arguments beyond the operands; decode_layers.py passes them to the kernel itself)."""
        row_blocks = -(-m // 32)
        # How the threads share the call: see COLUMN_MAJOR_BLOCKS.
        col_major = threads > 1 and row_blocks <= COLUMN_MAJOR_BLOCKS
        shared_split = (threads > 1 and not col_major and row_blocks <= SHARED_SPLIT_BLOCKS
                        and self.n_pad * self.k_pad * 6 >= SHARED_SPLIT_MIN_WEIGHT_BYTES)
        if shared_split:
            col_major, pass_blocks, copies = True, row_blocks, 1
        elif col_major:
            pass_blocks, copies = row_blocks, threads
        else:  # the most row blocks one thread's run can touch, at most a pass's worth
            run = -(-row_blocks * (self.n_pad // 32) // threads)
            pass_blocks, copies = min(PASS_BLOCKS, row_blocks, -(-run // (self.n_pad // 32)) + 1), threads
        kbs = self.k_pad // 32
        slab_blocks = max(1, SLAB_BYTES // (pass_blocks * 32 * 32 * 6))
        slabs = -(-kbs // slab_blocks)
        slab_blocks = -(-kbs // slabs)  # equal slabs
        return GemmPlan(pass_blocks, slab_blocks, int(col_major), int(shared_split),
                        copies * pass_blocks * 32 * self.k_pad * 3, copies * pass_blocks * 32 * self.n_pad)


class GemmPlan(NamedTuple):
    """The kernel's split of one call over its threads (SplitWeight.plan)."""

    pass_blocks: int
    slab_blocks: int
    col_major: int
    shared_split: int
    split_elems: int  # int16 elements of split rows the call needs
    acc_elems: int  # float32 elements of partial sums


def workspace(split_elems: int, acc_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's workspaces, grown to at least the sizes asked (kept: every step needs them)."""
    split = getattr(_workspaces, "split", None)
    if split is None or split.numel() < split_elems:
        split = _workspaces.split = torch.empty(split_elems, dtype=torch.int16)
    acc = getattr(_workspaces, "acc", None)
    if acc is None or acc.numel() < acc_elems:
        acc = _workspaces.acc = torch.empty(acc_elems, dtype=torch.float32)
    return split, acc


def _self_check() -> bool:
    """Products of awkward shapes (tails of rows, columns and inputs, two slabs, a bias) against
    float64: a kernel that is wrong on this CPU turns the path off instead of serving wrong logits."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((5, 40, 48), (260, 1100, 33), (70, 96, 70)):
        weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, k)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        got = SplitWeight(weight).linear(x, bias).double()
        want = x.double() @ weight.double().T + bias.double()
        scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()
        if not bool(((got - want).abs() <= SELF_CHECK_BOUND * scale).all()):
            return False
    return True


def library() -> ctypes.CDLL | None:
    """The kernel's library where the AMX GEMM is available (for callers of its entry points), else None."""
    return _library.get() if available() else None


def available() -> bool:
    """True when float32 weights can run on the AMX split kernel here (checked once per process)."""
    global _ready
    global _self_checking
    if _ready is not None:  # settled: every layer of every step asks, so no lock then
        return _ready
    with _lock:
        if _ready is None:
            ready = False
            if not _cpu_has_amx():
                log.info("no AMX on this CPU: float32 GEMMs stay on oneDNN / MKL")
            elif (lib := _library.get()) is None:
                log.info("the AMX GEMM did not build: float32 GEMMs stay on oneDNN / MKL")
            elif not lib.amx_request_permission():
                log.info("the kernel refused the AMX tile state: float32 GEMMs stay on oneDNN / MKL")
            else:
                _self_checking = True  # the self-check's own SplitWeights may be built
                try:
                    with torch.inference_mode():
                        ready = _self_check()
                finally:
                    _self_checking = False
                if not ready:
                    log.warning("the AMX GEMM failed its self-check: float32 GEMMs stay on oneDNN / MKL")
            _ready = ready  # only the final answer: read without the lock above
        return _ready

