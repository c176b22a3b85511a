"""The CPU kernels' C build (kernels/cpu/build.py): every source compiles without a warning, the cache
key follows the headers a source includes, a library is built once per process whichever thread asks
first, and no C source hides in a Python file."""

import ast
import re
import subprocess
import threading
from pathlib import Path

import pytest

from tokenmill.kernels.cpu import build

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted(build.CSRC.glob("*.c"))
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def test_the_package_holds_its_c_sources():
    assert {p.name for p in SOURCES} == {"amx_gemm.c", "amx_prefill_attention.c", "decode_attention.c",
                                         "decode_layers.c", "elementwise.c", "greedy_screen.c",
                                         "invariant_gemm.c", "row_logprobs.c", "row_sample.c"}
    assert (build.CSRC / "amx_tiles.h").exists()


@pytest.mark.slow
@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("march", ["-march=native", "-march=x86-64"], ids=["native", "portable"])
@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_source_compiles_with_the_production_flags_and_no_warning(source, march, tmp_path):
    """The production flags plus -Wall -Wextra -Werror. Native is what the engine builds here; a
    portable build (no AVX) compiles the scalar fallbacks a CPU without AVX2 or AVX-512 takes. The
    AMX sources compile on any x86-64 CPU (their target is set in amx_tiles.h), though only a CPU
    with AMX tiles runs them."""
    flags = [march if f == "-march=native" else f for f in build.FLAGS] + build.OPENMP_FLAGS + WARNINGS
    proc = subprocess.run(build.compile_command(build.find_compiler(), flags, source, tmp_path / "lib.so"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("march", ["-march=x86-64-v3", "-march=x86-64-v4"], ids=["avx2", "avx512"])
def test_the_fixed_order_gemm_compiles_its_avx2_and_avx512_tiles_without_a_warning(march, tmp_path):
    """invariant_gemm.c has a tile for AVX2 and one for AVX-512, and a CPU builds only its own: both
    are compiled here whatever this CPU has (compiled, not run)."""
    flags = [march if f == "-march=native" else f for f in build.FLAGS] + build.OPENMP_FLAGS + WARNINGS
    source = build.CSRC / "invariant_gemm.c"
    proc = subprocess.run(build.compile_command(build.find_compiler(), flags, source, tmp_path / "lib.so"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_source_builds_without_openmp(source, tmp_path):
    """The fallback build of a compiler without OpenMP (its pragmas ignored, so not warning-free)."""
    proc = subprocess.run(build.compile_command(build.find_compiler(), build.FLAGS, source, tmp_path / "lib.so"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_cache_key_covers_the_headers_a_source_includes(tmp_path):
    header = tmp_path / "shared.h"
    header.write_text("static int shared(void) { return 1; }\n")
    source = tmp_path / "user.c"
    source.write_text('#include "shared.h"\n#include <math.h>\nint f(void) { return shared(); }\n')
    before = build.source_text(source)
    assert "static int shared" in before and "int f(void)" in before
    header.write_text("static int shared(void) { return 2; }\n")
    assert build.source_text(source) != before


def test_no_c_source_inside_a_python_file():
    """C lives in kernels/cpu/csrc/ as real files, never in a string of the package's Python."""
    c_like = re.compile(r"#\s*include\s*[<\"]|#pragma\s+(omp|GCC|clang)")
    found = []
    for folder in ("worker", "kernels", "tools", "schemas"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and c_like.search(node.value):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def test_many_threads_asking_at_once_build_once_and_share_the_answer(monkeypatch):
    built, declared = [], []
    gate = threading.Event()

    def slow_build(source, what):
        gate.wait(5)  # every thread is inside get() before the build finishes
        built.append(source.name)
        return f"lib:{source.name}"

    monkeypatch.setattr(build, "build_library", slow_build)
    lib = build.OnDemandLibrary("once.c", "test", declared.append)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(lib.get())) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert answers == ["lib:once.c"] * 8
    assert built == ["once.c"] and declared == ["lib:once.c"]
    assert lib.get() == "lib:once.c" and built == ["once.c"]  # the settled answer, no second build


def test_a_failed_build_is_settled_as_none_and_not_retried(monkeypatch):
    calls = []

    def failing_build(source, what):
        calls.append(source.name)
        return None

    monkeypatch.setattr(build, "build_library", failing_build)
    lib = build.OnDemandLibrary("never.c", "test", lambda lib: None)
    assert lib.get() is None and lib.get() is None
    assert calls == ["never.c"]
