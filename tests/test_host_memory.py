"""Host memory for the CPU engine (worker/engine/cpu/host_memory.py): glibc malloc tuned so freed
activation memory stays mapped and steps stop faulting their pages in again, large tensors on huge
pages; a user's own choice is kept, each engine setting works both ways, and the engine applies both
before it loads its model."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from tokenmill.engine.cpu.host_memory import huge_pages_skip_reason, skip_reason

# Prefill-like steps of a small model: per layer a wide MLP activation and a narrower one, small
# tensors in between, over chunks of varying length; then the minor page faults of a second pass.
_STEPS = textwrap.dedent("""
    import resource, sys
    import torch
    from tokenmill.engine.cpu.host_memory import keep_freed_memory
    print(keep_freed_memory(sys.argv[1]))

    def steps():
        for t in (2048, 1500, 2048, 900, 2048, 1800):
            x = torch.ones(t, 256)
            for _ in range(4):
                small = [torch.ones(64) for _ in range(10)]
                a = torch.ones(t, 1376)
                b = torch.ones(t, 688)
                del a
                x = torch.ones(t, 256) + x
                del b, small
            logits = torch.ones(t // 4, 40000)  # above glibc's largest adaptive mmap threshold (32 MiB)
            del logits

    steps()
    # The fewest faults of three more passes: a pass of a tuned process can still fault pages in
    # when the machine reclaims some of its memory meanwhile (seen once in a full suite: 16,606
    # faults against 0-450 alone); an untuned one faults the large blocks in on every pass.
    passes = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        steps()
        passes.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(passes))
""")


def _clean_env() -> dict[str, str]:
    # torch's huge-page setting would fault 2 MiB at a time: not what the malloc test counts.
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}


def _faults(setting: str = "auto", **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _STEPS, setting], env={**_clean_env(), **env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    return out[0], int(out[1])


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_tuned_process_reuses_freed_activation_memory():
    state, tuned = _faults("on")
    assert state == "tuned"
    left_alone, default = _faults("off")
    assert left_alone == "skipped: malloc_tuning=off"
    # Default glibc gives pages back between steps and faults them in again (at least the blocks
    # above its largest adaptive mmap threshold: ~6 x 10,000 pages a pass here; 112,000 faults in
    # all on a 2-core EPYC); tuned, it keeps them (0 there).
    assert default > 50_000 and tuned < default / 20, (tuned, default)


@pytest.mark.parametrize(("env", "why"), [
    ({"MALLOC_TOP_PAD_": "1048576"}, "MALLOC_TOP_PAD_"),
    ({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "1"}, "MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "another allocator"),
])
def test_a_users_own_malloc_choice_is_left_alone(env, why):
    assert why in skip_reason(env)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_malloc_tuning_on_refuses_a_process_where_it_cannot_act():
    proc = subprocess.run([sys.executable, "-c", _STEPS, "on"], env={**_clean_env(), "MALLOC_TOP_PAD_": "1048576"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "malloc_tuning=on, but glibc malloc was not tuned (skipped: malloc already configured by MALLOC_TOP_PAD_)" \
        in proc.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_unrelated_environment_does_not_stop_tuning():
    assert skip_reason({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F", "LD_PRELOAD": "libfoo.so"}) is None


# A fresh process: the huge-page setting, then a large tensor written through; prints the setting's
# state and how much of the process's anonymous memory is on huge pages.
_HUGE = textwrap.dedent("""
    import os
    import sys
    import torch
    from tokenmill.engine.cpu.host_memory import large_tensors_on_huge_pages
    if sys.argv[1] == "late":
        early = torch.ones(1 << 21)  # 8 MiB before the engine asks: torch has made its choice
    state = large_tensors_on_huge_pages(sys.argv[2])
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ  # children keep the environment they had
    x = torch.ones(64 << 18)  # 64 MiB
    rollup = open("/proc/self/smaps_rollup").read()
    print(state)
    print(int(rollup.split("AnonHugePages:")[1].split()[0]))
""")


def _huge_pages(order: str, setting: str = "auto", **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", _HUGE, order, setting], env={**clean, **env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    return out[0], int(out[1])


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


@pytest.mark.slow
@pytest.mark.skipif(_thp_mode() == "absent", reason="a Linux kernel with transparent huge pages only")
def test_large_tensors_go_on_huge_pages_when_asked_in_time():
    state, huge_kb = _huge_pages("first")
    assert state == "on"
    if _thp_mode() in ("madvise", "always"):  # the kernel honours the advice: the 64 MiB lie on 2 MiB pages
        assert huge_kb >= 48 << 10, huge_kb
    late, _ = _huge_pages("late")
    assert late.startswith("too late"), late
    off, off_kb = _huge_pages("first", "off")
    assert off == "skipped: huge_pages=off"
    if _thp_mode() == "madvise":  # nothing advised, nothing huge (the kernel would not do it alone)
        assert off_kb < 8 << 10, off_kb


def test_a_users_own_huge_page_choice_is_left_alone():
    assert huge_pages_skip_reason({"THP_MEM_ALLOC_ENABLE": "0"}) == "THP_MEM_ALLOC_ENABLE=0 set by the user"


@pytest.mark.slow
@pytest.mark.skipif(_thp_mode() == "absent", reason="a Linux kernel with transparent huge pages only")
def test_huge_pages_on_refuses_a_process_where_it_is_too_late():
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    proc = subprocess.run([sys.executable, "-c", _HUGE, "late", "on"], env=clean, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "huge_pages=on, but large CPU tensors are not on huge pages (too late" in proc.stderr


# A fresh process that starts a CPU engine with the two settings given: prints what each did and
# whether a tensor of 2 MiB or more allocated after it is advised for huge pages. torch reads its
# huge-page switch at its first CPU allocation, once, so that says whether the settings acted before
# the engine (and its imports) first allocated. (The weights are mapped from a prepared file and the
# KV cache is advised by the model runner itself, so neither can tell.)
_ENGINE = textwrap.dedent("""
    import sys
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.engine.cpu import host_memory
    engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_gb=0.01, huge_pages=sys.argv[2],
                                 malloc_tuning=sys.argv[3]))
    import torch
    large = torch.empty(host_memory.HUGE_PAGE // 4 + 1, dtype=torch.float32)
    print(host_memory._huge_pages, host_memory._applied, "hg" in host_memory._mapping_flags(large.data_ptr()))
""")


@pytest.mark.skipif(_thp_mode() == "absent" or platform.libc_ver()[0] != "glibc",
                    reason="glibc on a Linux kernel with transparent huge pages only")
@pytest.mark.slow
def test_the_engine_applies_both_settings_before_it_loads_its_model():
    from tokenmill.tools.tiny_models import cached_tiny_model

    model_dir = cached_tiny_model("tiny-llama")  # an embedding of 32 MB

    def engine_run(huge_pages: str, malloc_tuning: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _ENGINE, str(model_dir), huge_pages, malloc_tuning],
                              env=_clean_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split()

    assert engine_run("auto", "auto") == ["on", "tuned", "True"]
    assert engine_run("off", "off") == ["None", "None", "False"]
