"""A CPU model's weights as the model holds them, kept in one file and used in place from a memory map.

Why: an engine's start on SmolLM2 (538 MB of float32) spent 0.6-0.9 CPU seconds copying the weights
from the checkpoint into the model's own tensors (q/k/v and gate/up fused) and 0.65-0.7 packing them
for oneDNN, on a 2-core EPYC; nearly all of both is the page faults of new memory, which on this
virtual machine cost several times what mapping a page of a file already in the page cache does.

So the first start on a checkpoint loads it as before and then writes every parameter (fused, in the
model's dtype) and every oneDNN-packed weight (kernels/cpu/onednn_bytes.py) into one file under
$TOKENMILL_CACHE/weights; later starts map that file and point the parameters and packed weights
into it. Nothing is copied or packed, and a page is read in only when a step first touches it (the
plain projection weights of a model whose layers run on oneDNN never are). The pages are the page
cache's, shared by every engine process on the machine that maps the same file. The
parameters are copy-on-write: an in-place reload writes private copies, and the packed weights follow
it (gemm.PackedWeight repacks a weight whose version changed).

The file is keyed by the checkpoint's weight files and config (name, size, modification time, inode),
the model's dtype, the CPU paths that decide what is packed, the torch version and the CPU's flags: a
key that differs is a miss (and the entry is written again), so a file packed for another CPU or
another oneDNN is never used. Layout: one JSON header line padded to a 4 KiB boundary, then each
tensor's bytes at a 4 KiB-aligned offset. Entries are not written where the disk would be left with
less than MIN_FREE_BYTES free; of the entries whose checkpoint folder still exists the most recently
used are kept, at most KEEP_ENTRIES of them and KEEP_BYTES together.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine import disk_cache
from tokenmill.kernels.cpu import onednn_bytes

log = logging.getLogger(__name__)

KIND = "weights"
FORMAT_VERSION = 1
ALIGN = 4096
KEEP_ENTRIES = 64
KEEP_BYTES = 16 << 30
MIN_FREE_BYTES = 2 << 30

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


@dataclass
class PreparedWeights:
    """What a prepared file holds: the parameters by name, the oneDNN-packed weights by name."""

    parameters: dict[str, torch.Tensor]
    packed: dict[str, torch.Tensor]


def entry_key(model_dir: Path, weight_files: list[Path], dtype: torch.dtype, layout: Mapping[str, Any]) -> dict[str, Any]:
    """What an entry is valid for (see the module docstring); `layout` names the model's choices that
    change what it holds (its CPU paths, the packed row hint)."""
    folder = Path(model_dir).resolve()
    files = [disk_cache.file_identity(p) for p in weight_files]
    files += [disk_cache.file_identity(folder / name) for name in ("config.json",) if (folder / name).exists()]
    return {
        "version": FORMAT_VERSION, "folder": str(folder), "files": files, "dtype": str(dtype),
        "layout": dict(layout), "torch": torch.__version__, "machine": platform.machine(), "cpu": _cpu_flags(),
    }


def entry_path(model_dir: Path, key: dict[str, Any]) -> Path:
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return disk_cache.entry_path(KIND, model_dir, f"-{digest}.bin")


def load(model_dir: Path, key: dict[str, Any]) -> PreparedWeights | None:
    """The entry for `key` mapped into memory, or None (no entry, another key, unreadable, or packed
    weights that cannot be made from bytes here)."""
    path = entry_path(model_dir, key)
    try:
        with open(path, "rb") as f:
            header = disk_cache.read_key(f)
            data_start = f.tell()
        size = path.stat().st_size
    except OSError:
        return None
    if header is None or header.get("key") != key or header.get("bytes") != size:
        return None
    plain, onednn = header.get("tensors", {}), header.get("packed", {})
    if onednn and not onednn_bytes.available():
        return None
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        descriptors = [bytes.fromhex(md) for md in header.get("descriptors", [])]
        parameters, packed = {}, {}
        for name, t in plain.items():
            dtype = _DTYPES[t["dtype"]]
            itemsize = torch.empty(0, dtype=dtype).element_size()
            offset = data_start + t["offset"]
            parameters[name] = torch.empty(0, dtype=dtype).set_(storage, offset // itemsize, tuple(t["shape"]))
        for name, t in onednn.items():
            memory = torch.empty(0, dtype=torch.uint8).set_(storage, data_start + t["offset"], (t["nbytes"],))
            packed[name] = onednn_bytes.from_bytes(descriptors[t["md"]], memory, tuple(t["shape"]))
    except (RuntimeError, KeyError, IndexError, ValueError, TypeError) as exc:
        log.warning("ignoring the prepared weights %s: %s", path, exc)
        return None
    disk_cache.touch(path)
    return PreparedWeights(parameters, packed)


def save(model_dir: Path, key: dict[str, Any], parameters: Mapping[str, torch.Tensor],
         packed: Mapping[str, torch.Tensor]) -> Path | None:
    """Write the entry for `key` (parameters: CPU tensors by name; packed: oneDNN-packed weights by
    name). Returns its path, or None where it was not written (no room, the cache not writable, packed
    weights that cannot be read back here): the next start then loads the checkpoint again."""
    if packed and not onednn_bytes.available():
        return None
    tensors: dict[str, dict[str, Any]] = {}
    chunks: list[tuple[int, memoryview]] = []
    offset = 0
    for name, tensor in parameters.items():
        t = tensor.detach()
        if t.device.type != "cpu" or str(t.dtype) not in _DTYPES:
            return None
        view = t.contiguous().view(-1).view(torch.uint8).numpy().data
        tensors[name] = {"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset}
        chunks.append((offset, view))
        offset = _aligned(offset + view.nbytes)
    descriptors: list[str] = []  # the packed layouts, once each (a model has a few shapes)
    onednn: dict[str, dict[str, Any]] = {}
    for name, weight in packed.items():
        view = onednn_bytes.data(weight)
        md = onednn_bytes.descriptor(weight).hex()
        if md not in descriptors:
            descriptors.append(md)
        onednn[name] = {"shape": list(weight.shape), "offset": offset, "nbytes": view.nbytes,
                        "md": descriptors.index(md)}
        chunks.append((offset, view))
        offset = _aligned(offset + view.nbytes)
    path = entry_path(model_dir, key)
    header = {"key": key, "tensors": tensors, "packed": onednn, "descriptors": descriptors}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < offset + MIN_FREE_BYTES:
            log.info("not keeping prepared weights of %s: under %d GiB would be left free", model_dir,
                     MIN_FREE_BYTES >> 30)
            return None
        header_bytes = _padded_header(header, offset)
        disk_cache.write_entry(path, _body(header_bytes, chunks, offset))
        disk_cache.prune(KIND, KEEP_ENTRIES, KEEP_BYTES)
    except OSError as exc:
        log.info("cannot keep prepared weights of %s (%s): the next start loads the checkpoint again", model_dir, exc)
        return None
    return path


def _padded_header(header: dict[str, Any], data_bytes: int) -> bytes:
    """The header line, padded with spaces to a multiple of ALIGN; "bytes" is the whole file's size."""
    import json

    length = ALIGN
    while True:
        line = json.dumps({**header, "bytes": length + data_bytes}, separators=(",", ":")).encode()
        if len(line) + 1 <= length:
            return line + b" " * (length - len(line) - 1) + b"\n"
        length = _aligned(len(line) + 1)


def _body(header: bytes, chunks: list[tuple[int, memoryview]], total: int) -> Iterator[bytes | memoryview]:
    yield header
    written = 0
    for offset, view in chunks:
        if offset > written:
            yield bytes(offset - written)
        yield view
        written = offset + view.nbytes
    if total > written:
        yield bytes(total - written)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.startswith(("flags", "model name"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or os.name
