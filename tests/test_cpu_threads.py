"""The CPU engine's thread count: --cpu-threads when given, else torch's own count capped at the
cgroup's CPU quota (a container limited to fewer CPUs than its node shows)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.cpu.threads import cgroup_cpu_quota, resolve_cpu_threads


def _v2(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _v1(tmp_path, quota, period="100000"):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


@pytest.mark.parametrize(("text", "quota"), [("max 100000\n", None), ("250000 100000\n", 2.5),
                                             ("400000 100000\n", 4.0), ("50000 100000", 0.5)])
def test_the_v2_quota_is_read_from_cpu_max(tmp_path, text, quota):
    assert cgroup_cpu_quota(_v2(tmp_path, text)) == quota


@pytest.mark.parametrize(("quota_us", "quota"), [("-1", None), ("200000", 2.0), ("150000", 1.5)])
def test_the_v1_quota_is_read_from_cfs_files(tmp_path, quota_us, quota):
    assert cgroup_cpu_quota(_v1(tmp_path, quota_us)) == quota


def test_no_cgroup_files_or_garbage_is_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(_v2(tmp_path, "lots of cpu")) is None


def test_the_setting_wins_over_torch_and_the_quota():
    assert resolve_cpu_threads(3, current=16, quota=2.0) == (3, "--cpu-threads")


@pytest.mark.parametrize(("current", "quota", "threads"), [
    (64, 4.0, 4),  # a 64-core node, a 4-CPU limit
    (64, 2.5, 3),  # rounded up
    (8, 0.5, 1),
    (2, 4.0, 2),  # under the quota: left alone
    (16, None, 16),  # no quota
])
def test_unset_takes_torchs_count_capped_at_the_quota(current, quota, threads):
    assert resolve_cpu_threads(None, current=current, quota=quota)[0] == threads


def test_the_engine_sets_the_thread_count_it_is_given(tiny_llama_dir):
    from tokenmill.engine import Engine, EngineConfig

    before = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01, cpu_threads=2))
        assert engine.cpu_threads == 2 and torch.get_num_threads() == 2
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_gb=0.01))
        assert engine.cpu_threads == 2  # unset: the process's count stays
    finally:
        torch.set_num_threads(before)


def test_the_flag_is_refused_below_1():
    with pytest.raises(ValueError, match="cpu_threads"):
        from tokenmill.engine import EngineConfig

        EngineConfig(model="m", cpu_threads=0)
