"""glibc malloc tuning for the CPU engine (worker/engine/host_memory.py): freed activation memory
stays mapped, so steps stop faulting their pages in again; a user's own malloc choice is kept."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from tokenmill.engine.host_memory import skip_reason

# Prefill-like steps of a small model: per layer a wide MLP activation and a narrower one, small
# tensors in between, over chunks of varying length; then the minor page faults of a second pass.
_STEPS = textwrap.dedent("""
    import resource, sys
    import torch
    from tokenmill.engine.host_memory import keep_freed_memory
    print(keep_freed_memory())

    def steps():
        for t in (2048, 1500, 2048, 900, 2048, 1800) * 3:
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


def _faults(**env) -> tuple[str, int]:
    # torch's huge-page setting would fault 2 MiB at a time: not what this test counts.
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
    out = subprocess.run([sys.executable, "-c", _STEPS], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_tuned_process_reuses_freed_activation_memory():
    state, tuned = _faults()
    assert state == "tuned"
    left_alone, default = _faults(TOKENMILL_MALLOC_TUNING="0")
    assert left_alone == "skipped: TOKENMILL_MALLOC_TUNING=0"
    # Default glibc gives pages back between steps and faults them in again (at least the blocks
    # above its largest adaptive mmap threshold: ~18 x 10,000 pages here); tuned, it keeps them.
    assert default > 100_000 and tuned < default / 20, (tuned, default)


@pytest.mark.parametrize(("env", "why"), [
    ({"TOKENMILL_MALLOC_TUNING": "0"}, "TOKENMILL_MALLOC_TUNING=0"),
    ({"MALLOC_TOP_PAD_": "1048576"}, "MALLOC_TOP_PAD_"),
    ({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "1"}, "MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "another allocator"),
])
def test_a_users_own_malloc_choice_is_left_alone(env, why):
    assert why in skip_reason(env)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_unrelated_environment_does_not_stop_tuning():
    assert skip_reason({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F", "LD_PRELOAD": "libfoo.so"}) is None


# A fresh process: the huge-page setting, then a large tensor written through; prints the setting's
# state and how much of the process's anonymous memory is on huge pages.
_HUGE = textwrap.dedent("""
    import os
    import sys
    import torch
    from tokenmill.engine.host_memory import large_tensors_on_huge_pages
    if sys.argv[1] == "late":
        early = torch.ones(1 << 21)  # 8 MiB before the engine asks: torch has made its choice
    state = large_tensors_on_huge_pages()
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ  # children keep the environment they had
    x = torch.ones(64 << 18)  # 64 MiB
    rollup = open("/proc/self/smaps_rollup").read()
    print(state)
    print(int(rollup.split("AnonHugePages:")[1].split()[0]))
""")


def _huge_pages(order: str, **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "TOKENMILL_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", _HUGE, order], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    return out[0], int(out[1])


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


@pytest.mark.skipif(_thp_mode() == "absent", reason="a Linux kernel with transparent huge pages only")
def test_large_tensors_go_on_huge_pages_when_asked_in_time():
    state, huge_kb = _huge_pages("first")
    assert state == "on"
    if _thp_mode() in ("madvise", "always"):  # the kernel honours the advice: the 64 MiB lie on 2 MiB pages
        assert huge_kb >= 48 << 10, huge_kb
    late, _ = _huge_pages("late")
    assert late.startswith("too late"), late
    off, off_kb = _huge_pages("first", TOKENMILL_HUGE_PAGES="0")
    assert off == "skipped: TOKENMILL_HUGE_PAGES=0"
    if _thp_mode() == "madvise":  # nothing advised, nothing huge (the kernel would not do it alone)
        assert off_kb < 8 << 10, off_kb


@pytest.mark.parametrize(("env", "why"), [
    ({"TOKENMILL_HUGE_PAGES": "0"}, "TOKENMILL_HUGE_PAGES=0"),
    ({"THP_MEM_ALLOC_ENABLE": "0"}, "THP_MEM_ALLOC_ENABLE=0 set by the user"),
])
def test_a_users_own_huge_page_choice_is_left_alone(env, why):
    from tokenmill.engine.host_memory import huge_pages_skip_reason

    assert huge_pages_skip_reason(env) == why


def test_a_mistyped_huge_page_switch_is_an_error_not_the_default():
    from tokenmill.engine.host_memory import huge_pages_skip_reason

    with pytest.raises(ValueError, match="TOKENMILL_HUGE_PAGES"):
        huge_pages_skip_reason({"TOKENMILL_HUGE_PAGES": "of"})
