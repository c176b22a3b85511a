"""Build a small C library with the system compiler on first use, cached on disk.

The CPU kernels that torch has no op for (decode attention over the paged cache, the greedy head's
candidate check) are plain C, not C++ against torch headers, so they compile in well under a second.
A library is cached under a key of its source, the compiler, its flags and the CPU, so a change to
any of them builds anew and a machine never loads code built for another CPU's instructions.

Each is built with OpenMP where the compiler has it: the library then links libgomp.so.1, which in a
process that has loaded torch is torch's copy, so the kernel runs on the threads of torch's own pool
(the ones that ran the step's GEMMs) instead of competing with them. Without OpenMP the same source
builds serially (or with the pthreads it brings itself).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# gnu99 (not c99) keeps -ffp-contract=fast, i.e. fused multiply-add where the source writes a * b + c;
# no -ffast-math, so expf, inf and NaN keep their IEEE behaviour.
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", "-pthread"]
OPENMP_FLAGS = ["-fopenmp"]


def cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root) / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile(name: str, source: str, compiler: str, flags: list[str]) -> tuple[Path | None, str]:
    """The cached library built with `flags` (built now if missing), or (None, the compiler's error)."""
    key = hashlib.sha256("\0".join([source, compiler, *flags, platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{key}.so"
    if target.exists():
        return target, ""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        built = Path(tmp) / f"{name}.so"
        proc = subprocess.run([compiler, *flags, str(src), "-o", str(built), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return None, proc.stderr[-2000:]
        os.replace(built, target)  # atomic: concurrent builders all end with a complete file
    return target, ""


def build_library(name: str, source: str, what: str) -> ctypes.CDLL | None:
    """`source` compiled (with OpenMP if the compiler has it) and loaded; None where there is no C
    compiler or the build fails, logged with `what` (the caller then keeps its torch path)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or platform.system() != "Linux":
        log.info("no C compiler found: %s uses the plain torch path", what)
        return None
    target, error = None, ""
    try:
        for flags in ([*FLAGS, *OPENMP_FLAGS], FLAGS):
            target, error = _compile(name, source, compiler, flags)
            if target is not None:
                break
        if target is None:
            log.warning("building the %s failed; using plain torch: %s", what, error)
            return None
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s); using plain torch", what, exc)
        return None


class OnDemandLibrary:
    """A C library built and loaded on first use, once per process, whichever thread asks first.

    declare(lib) sets the functions' ctypes signatures. get() is None where the library cannot be
    built (no compiler, a failed build): the caller keeps its torch path."""

    def __init__(self, name: str, source: str, what: str, declare: Callable[[ctypes.CDLL], None]):
        self._name, self._source, self._what, self._declare = name, source, what, declare
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        # Set once the answer is final, even when the build raised (it is not tried again): from
        # then on get() reads it without the lock (the kernels ask once per call, several times
        # per layer, on the step's host path).
        self._settled = False

    def get(self) -> ctypes.CDLL | None:
        if self._settled:
            return self._lib
        with self._lock:
            if not self._settled:
                try:
                    lib = build_library(self._name, self._source, self._what)
                    if lib is not None:
                        self._declare(lib)
                    self._lib = lib
                finally:
                    self._settled = True
            return self._lib
