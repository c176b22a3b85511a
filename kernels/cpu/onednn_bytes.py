"""oneDNN's packed weights (gemm.pack) as bytes, and back into a packed weight over memory it does
not own: a packed weight kept in a file is used in place from a memory map, with no reorder and no
copy at an engine's start.

Why: packing SmolLM2's weights (538 MB of float32) for oneDNN cost 0.65-0.7 CPU seconds of each start
on a 2-core EPYC, most of it the page faults of the new memory (on this virtual machine a fresh page
costs several times what mapping a page of a file in the page cache does).

A packed weight is an opaque oneDNN tensor: its bytes in the blocked layout oneDNN chose for this CPU,
and a memory descriptor that says which layout that is. torch exposes both (mkldnn.data_ptr, _nbytes,
_get_mkldnn_serialized_md: what AOTInductor writes for its packed constants) and makes an opaque tensor
over given memory with a given descriptor through the C shim AOTInductor's compiled models call
(aoti_torch_create_tensor_from_blob_v2 with the mkldnn layout). The made tensor does not own its
memory: it holds a reference to the tensor whose memory it uses, so the mapping lives as long as it.
A self-check, once per process, packs a small weight, makes it again from its bytes and compares a
product bit for bit; where any step is missing or differs, available() is False and weights are
packed at load as before.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from tokenmill.kernels.cpu import gemm

log = logging.getLogger(__name__)

_lock = threading.Lock()
_shim: tuple | None = None  # (create function, dtype code, layout code, device code), or () when missing
_available: bool | None = None


def descriptor(packed: torch.Tensor) -> bytes:
    """The packed weight's oneDNN memory descriptor (its layout on this CPU), serialised."""
    return torch.ops.mkldnn._get_mkldnn_serialized_md(packed).numpy().tobytes()


def data(packed: torch.Tensor) -> memoryview:
    """The packed weight's bytes, in place (valid while `packed` lives)."""
    size = torch.ops.mkldnn._nbytes(packed)
    return memoryview((ctypes.c_uint8 * size).from_address(torch.ops.mkldnn.data_ptr(packed))).cast("B")


def from_bytes(md: bytes, memory: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A float32 packed weight of `shape` over `memory` (a uint8 CPU tensor of its bytes, e.g. a slice
    of a memory-mapped file) with the layout `md` describes. Raises RuntimeError where it cannot."""
    create, dtype, layout, device = _c_shim()
    if memory.dtype != torch.uint8 or memory.device.type != "cpu" or not memory.is_contiguous():
        raise RuntimeError("a packed weight's memory must be a contiguous uint8 CPU tensor")
    sizes = (ctypes.c_int64 * 2)(*shape)
    strides = (ctypes.c_int64 * 2)(shape[1], 1)
    handle = ctypes.c_void_p()
    code = create(memory.data_ptr(), 2, sizes, strides, 0, dtype, device, 0, ctypes.byref(handle), layout,
                  md, len(md))
    if code != 0 or not handle.value:
        raise RuntimeError(f"aoti_torch_create_tensor_from_blob_v2 failed ({code})")
    capsule = _new_capsule(handle.value, None, None)
    packed = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule)
    if torch.ops.mkldnn._nbytes(packed) != memory.numel():
        raise RuntimeError("the descriptor does not describe this many bytes")
    packed._tokenmill_memory = memory  # the tensor does not own its memory: keep it alive with it
    return packed


def available() -> bool:
    """True when packed weights can be made from their bytes here (checked once per process)."""
    global _available
    if _available is not None:
        return _available
    with _lock:
        if _available is None:
            try:
                _available = gemm.available() and _self_check()
            except (RuntimeError, AttributeError, OSError, TypeError) as exc:
                log.info("packed oneDNN weights cannot be read back here (%s): they are packed at load", exc)
                _available = False
        return _available


def _self_check() -> bool:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen)
    x = torch.randn(7, 24, generator=gen)
    packed = gemm.pack(weight)
    copy = torch.frombuffer(bytearray(data(packed)), dtype=torch.uint8)
    again = from_bytes(descriptor(packed), copy, tuple(weight.shape))
    return torch.equal(gemm.linear(x, weight, None, packed), gemm.linear(x, weight, None, again))


def _c_shim() -> tuple:
    global _shim
    if _shim is None:
        try:
            lib = ctypes.CDLL(torch._C.__file__)  # its dependencies include libtorch_cpu, which exports the shim
            create = lib.aoti_torch_create_tensor_from_blob_v2
            create.restype = ctypes.c_int32
            create.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                               ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                               ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_char_p,
                               ctypes.c_int64]
            codes = []
            for name in ("aoti_torch_dtype_float32", "aoti_torch_layout__mkldnn", "aoti_torch_device_type_cpu"):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int32
                codes.append(fn())
            _shim = (create, *codes)
        except (OSError, AttributeError) as exc:
            log.info("torch has no AOTInductor shim to make packed weights from bytes (%s)", exc)
            _shim = ()
    if not _shim:
        raise RuntimeError("torch's AOTInductor shim is not available")
    return _shim


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
