"""Build one of the package's C sources (csrc/) with the system compiler on first use, cached on disk.

The CPU kernels that torch has no op for (decode attention over the paged cache, the greedy head's
candidate check, ...) are plain C, not C++ against torch headers, so they compile in well under a
second. A library is cached under a key of its source (with the package headers it includes), the
compiler, its flags and the CPU, so a change to any of them builds anew and a machine never loads
code built for another CPU's instructions. The cache lives under $TOKENMILL_CACHE/kernels (default
~/.cache/tokenmill/kernels).

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
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# The C sources and the headers they share; shipped in the wheel as package data.
CSRC = Path(__file__).resolve().parent / "csrc"

# gnu99 (not c99) keeps -ffp-contract=fast, i.e. fused multiply-add where the source writes a * b + c;
# no -ffast-math, so expf, inf and NaN keep their IEEE behaviour.
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", "-pthread"]
OPENMP_FLAGS = ["-fopenmp"]

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root) / "kernels"


def source_path(file_name: str) -> Path:
    """The path of a C source of this package (csrc/<file_name>)."""
    return CSRC / file_name


def source_text(path: Path) -> str:
    """The source with every package header it includes ("..."), in include order: what the cache key
    hashes, so an edit of a shared header builds its libraries anew."""
    seen: list[Path] = []

    def visit(p: Path) -> None:
        if p in seen:
            return
        seen.append(p)
        for name in _LOCAL_INCLUDE.findall(p.read_text(encoding="utf-8")):
            visit(p.parent / name)

    visit(path)
    return "\0".join(p.read_text(encoding="utf-8") for p in seen)


def compile_command(compiler: str, flags: list[str], source: Path, target: Path) -> list[str]:
    """The compiler's command line for one library (the tests add warning flags to the same line)."""
    return [compiler, *flags, f"-I{source.parent}", str(source), "-o", str(target), "-lm"]


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile(source: Path, compiler: str, flags: list[str]) -> tuple[Path | None, str]:
    """The cached library built with `flags` (built now if missing), or (None, the compiler's error)."""
    parts = [source_text(source), compiler, *flags, platform.machine(), _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if target.exists():
        return target, ""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / f"{source.stem}.so"
        proc = subprocess.run(compile_command(compiler, flags, source, built), capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            return None, proc.stderr[-2000:]
        os.replace(built, target)  # atomic: concurrent builders all end with a complete file
    return target, ""


def build_library(source: Path, what: str) -> ctypes.CDLL | None:
    """`source` compiled (with OpenMP if the compiler has it) and loaded; None where there is no C
    compiler or the build fails, logged with `what` (the caller then keeps its torch path)."""
    compiler = find_compiler()
    if not compiler or platform.system() != "Linux":
        log.info("no C compiler found: %s uses the plain torch path", what)
        return None
    target, error = None, ""
    try:
        for flags in ([*FLAGS, *OPENMP_FLAGS], FLAGS):
            target, error = _compile(source, compiler, flags)
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
    """A library of one C source of csrc/, built and loaded on first use, once per process, whichever
    thread asks first.

    declare(lib) sets the functions' ctypes signatures. get() is None where the library cannot be
    built (no compiler, a failed build): the caller keeps its torch path."""

    def __init__(self, file_name: str, what: str, declare: Callable[[ctypes.CDLL], None]):
        self.source = source_path(file_name)
        self._what, self._declare = what, declare
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
                    lib = build_library(self.source, self._what)
                    if lib is not None:
                        self._declare(lib)
                    self._lib = lib
                finally:
                    self._settled = True
            return self._lib
