"""How many threads the CPU engine computes with.

torch's own default is the number of CPUs the process may run on (its affinity mask), or
OMP_NUM_THREADS when that is set. In a container with a CPU quota (a Kubernetes `cpu` limit, say
4 CPUs on a 64-core node) the mask still names every core of the node: 64 threads then share 4
CPUs' worth of time, and each parallel region waits for threads the quota has descheduled. So:

- `cpu_threads` set (`--cpu-threads`): exactly that many.
- Unset: the process's current torch thread count (which honours OMP_NUM_THREADS, the affinity
  mask and a caller's own torch.set_num_threads), lowered to the CPU quota of the process's
  cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up.
"""

from __future__ import annotations

import math
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the process's cgroup may use (e.g. 2.5), or None when unlimited or
    unreadable. Reads the cgroup at `root` (the container's own view of its cgroup)."""
    v2 = root / "cpu.max"
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else _positive_ratio(quota, period)
    except (OSError, ValueError):
        pass
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _positive_ratio(quota, period)


def _positive_ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for "no limit"


def resolve_cpu_threads(setting: int | None, current: int, quota: float | None) -> tuple[int, str]:
    """(threads, why) for the CPU engine: `setting` when given, else `current` (torch's count now)
    capped at the quota rounded up."""
    if setting is not None:
        return setting, "--cpu-threads"
    if quota is not None and current > math.ceil(quota):
        return max(1, math.ceil(quota)), f"the cgroup CPU quota ({quota:g} CPUs)"
    return current, "torch's default (OMP_NUM_THREADS or the CPUs this process may use)"


def apply_cpu_threads(setting: int | None) -> tuple[int, str]:
    """Set torch's intra-op thread count for the CPU engine; returns (threads, why)."""
    import torch

    current = torch.get_num_threads()
    threads, why = resolve_cpu_threads(setting, current, cgroup_cpu_quota())
    if threads != current:
        torch.set_num_threads(threads)
    return threads, why
