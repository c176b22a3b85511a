"""A pure decode step's decoder layers in one C call on the CPU: the same kernels, no Python between.

Why: a decode layer is eight kernel calls (two add + RMSNorm passes, four AMX projections, the
rotary with the K/V write, the decode attention), each behind a Python wrapper that checks its
tensors, sizes its threads and workspaces and crosses ctypes, and the layer's own Python between
them. On a tiny model's decode step that is several percent of the step, run on one core while the
other waits, and it runs slower inside a step than in a loop: the kernels stream megabytes of
weights through both cores' caches between two Python calls. Here Python fills one description of
the step (the buffers, each projection's split over the threads as SplitWeight.plan gives it, the
attention rows of the backend's plan) and one per layer (its weights and cache), and a small C
loop calls the kernels' own entry points in the layer's order.

Same bits as the Python path: the same kernels get the same arguments in the same order (tested
against it: the final hidden states and the K/V written, bit for bit, at 1 and 2 threads). Only a pure decode step of a float32
model whose projections all run on the AMX kernel, without q/k norms, with the C element-wise
kernels and the C decode attention, takes this path; every other step keeps the Python layers.
The engine's `decode_layers_in_c` setting turns it off (paths.py). The loop is csrc/decode_layers.c.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from tokenmill.kernels.cpu import amx_gemm, decode_attention, elementwise
from tokenmill.kernels.cpu.build import OnDemandLibrary

log = logging.getLogger(__name__)


# The C structures of csrc/decode_layers.c, field for field.
class _GemmSpec(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("n", "n_pad", "k", "k_pad", "pass_blocks", "slab_blocks", "col_major", "shared_split")]


class _LayerPtrs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "qkv_bias", "o_bias", "qkv", "o", "gate_up", "down", "key_cache",
                 "value_cache")]


class _Step(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_int64) for name in
         ("m", "hidden", "heads", "kv_heads", "head_dim", "block_size", "intermediate", "lanes", "norm_threads",
          "rotary_threads", "gemm_threads", "attention_threads")]
        + [("eps", ctypes.c_double), ("scale", ctypes.c_double)]
        + [(name, ctypes.c_void_p) for name in ("cos_t", "sin_t", "slots", "block_tables")]
        + [("table_stride", ctypes.c_int64)]
        + [(name, ctypes.c_void_p) for name in ("token_index", "table_row", "seq_lens")]
        + [("max_len", ctypes.c_int64)]
        + [(name, _GemmSpec) for name in ("qkv", "o", "gate_up", "down")]
        + [(name, ctypes.c_void_p) for name in
           ("split_ws", "acc_ws", "hidden_in", "normed", "res_a", "res_b", "qkv_out", "q", "attn_out", "o_out",
            "gate_up_out", "down_out", "norm", "rotary", "gemm", "attention")]
    )


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.decode_layers.restype = ctypes.c_int


_library = OnDemandLibrary("decode_layers.c", "CPU decode-layers driver", _declare)


def available() -> bool:
    """True where the driver's own loop is built (a C compiler; checked once per process)."""
    return _library.get() is not None


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


class DecodeLayers:
    """Runs a model's decoder layers for a pure decode step in one C call (see the module docstring).

    Built once per model (`for_model`, None where the path cannot apply); `run` returns None for a
    step it does not take, and the caller runs the Python layers."""

    def __init__(self, layers, lib: ctypes.CDLL, kernels: dict[str, int]):
        self._layers = layers
        self._lib = lib
        self._kernels = kernels
        first = layers[0]
        self.hidden = first.input_norm.shape[0]
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.intermediate = first.down_weight.shape[1]
        self.eps, self.scale = first.eps, first.scale

    @classmethod
    def for_model(cls, layers) -> DecodeLayers | None:
        """The driver for these DecoderLayers, or None: a library missing, a layer whose projections are
        not all on the AMX kernel, or q/k norms (Qwen3 keeps its two calls). The caller asks only
        where the engine takes this path (paths.CpuPaths.decode_layers_in_c)."""
        if not len(layers):
            return None
        for layer in layers:
            packed = layer._packed
            if packed is None or any(w.kind != "amx" for w in packed.values()) or layer.qk_norm is not None:
                return None
            if not all(_plain_bias(b) for b in (layer.qkv_bias, layer.o_bias)):
                return None  # the kernel reads a bias as float32 in place
        norms, attention = elementwise.library(), decode_attention.load()
        gemm, lib = amx_gemm.library(), _library.get()
        if norms is None or attention is None or gemm is None or lib is None:
            return None
        kernels = {"norm": _address(norms.add_rms_norm_f32), "rotary": _address(norms.rotary_write_kv_f32),
                   "gemm": _address(gemm.amx_gemm), "attention": _address(attention.paged_decode_attention_f32)}
        return cls(list(layers), lib, kernels)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, meta,
            kv_caches, backend) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual) for the final norm, as the Python layers give them, or None
        when this step is not one the driver takes (nothing has been computed then)."""
        m, h = hidden.shape
        if (m == 0 or h != self.hidden or hidden.dtype != torch.float32 or not hidden.is_contiguous()
                or cos is None or sin is None or not cos.is_contiguous() or not sin.is_contiguous()
                or cos.shape != (m, 1, self.head_dim // 2) or sin.shape != cos.shape
                or not getattr(backend, "kv_write_is_plain_copy", False) or not hasattr(backend, "decode_kernel_rows")):
            return None
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or slots.shape != (m,) or not slots.is_contiguous():
            return None
        key_cache, value_cache = kv_caches[0]
        if key_cache.dim() != 4 or key_cache.shape[2:] != (self.kv_heads, self.head_dim):
            return None
        rows = backend.decode_kernel_rows(meta, key_cache, value_cache, self.head_dim)
        lanes = elementwise.norm_lanes(h)
        if rows is None or lanes is None:
            return None
        layer_ptrs = (_LayerPtrs * len(self._layers))()
        for ptrs, layer, (kc, vc) in zip(layer_ptrs, self._layers, kv_caches, strict=True):
            if not (kc.is_contiguous() and vc.is_contiguous() and kc.shape == key_cache.shape and vc.shape == kc.shape
                    and kc.dtype == torch.float32 and vc.dtype == torch.float32):
                return None
            packed = layer._packed
            ptrs.input_norm, ptrs.post_norm = layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr()
            ptrs.qkv_bias = _bias_ptr(layer.qkv_bias)
            ptrs.o_bias = _bias_ptr(layer.o_bias)
            ptrs.qkv, ptrs.o = packed["qkv_weight"].packed().packed.data_ptr(), packed["o_weight"].packed().packed.data_ptr()
            ptrs.gate_up = packed["gate_up_weight"].packed().packed.data_ptr()
            ptrs.down = packed["down_weight"].packed().packed.data_ptr()
            ptrs.key_cache, ptrs.value_cache = kc.data_ptr(), vc.data_ptr()

        first = self._layers[0]._packed
        threads = torch.get_num_threads()
        step = _Step()
        split_elems = acc_elems = 0
        for name, weight in (("qkv", "qkv_weight"), ("o", "o_weight"), ("gate_up", "gate_up_weight"),
                             ("down", "down_weight")):
            sw = first[weight].packed()
            plan = sw.plan(m, threads)
            setattr(step, name, _GemmSpec(sw.n, sw.n_pad, sw.k, sw.k_pad, plan.pass_blocks, plan.slab_blocks,
                                          plan.col_major, plan.shared_split))
            split_elems, acc_elems = max(split_elems, plan.split_elems), max(acc_elems, plan.acc_elems)
        split_ws, acc_ws = amx_gemm.workspace(split_elems, acc_elems)

        qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        q_size = self.heads * self.head_dim
        buffers = {
            "normed": torch.empty(m, h), "res_a": torch.empty(m, h), "res_b": torch.empty(m, h),
            "qkv_out": torch.empty(m, qkv_width), "q": torch.empty(m, q_size), "attn_out": torch.empty(m, q_size),
            "o_out": torch.empty(m, h), "gate_up_out": torch.empty(m, 2 * self.intermediate),
            "down_out": torch.empty(m, h),
        }
        step.m, step.hidden, step.heads, step.kv_heads, step.head_dim = m, h, self.heads, self.kv_heads, self.head_dim
        step.block_size, step.intermediate, step.lanes = key_cache.shape[1], self.intermediate, lanes
        step.norm_threads = elementwise.threads_for(m * h)
        step.rotary_threads = elementwise.threads_for(m * qkv_width)
        step.gemm_threads = step.attention_threads = threads
        step.eps, step.scale = self.eps, self.scale
        step.cos_t, step.sin_t, step.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        step.block_tables, step.table_stride = rows.block_tables.data_ptr(), rows.block_tables.stride(0)
        step.token_index, step.table_row = rows.token_index.data_ptr(), rows.table_row.data_ptr()
        step.seq_lens, step.max_len = rows.seq_lens.data_ptr(), max(int(rows.max_len), 1)
        step.split_ws, step.acc_ws = split_ws.data_ptr(), acc_ws.data_ptr()
        step.hidden_in = hidden.data_ptr()
        for name, buffer in buffers.items():
            setattr(step, name, buffer.data_ptr())
        for name, address in self._kernels.items():
            setattr(step, name, address)
        which = self._lib.decode_layers(ctypes.addressof(step), ctypes.addressof(layer_ptrs), len(self._layers))
        if which < 0:
            raise MemoryError("CPU decode attention kernel could not allocate its scratch buffer")
        return buffers["down_out"], buffers["res_a"] if which == 0 else buffers["res_b"]


def _plain_bias(bias: torch.Tensor | None) -> bool:
    return bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())


def _bias_ptr(bias: torch.Tensor | None) -> int | None:
    return None if bias is None else bias.data_ptr()
