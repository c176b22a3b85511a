"""Rebalance storms: workers joining and leaving every few seconds for a minute (1 -> 4 -> 1 -> 3,
departures alternating SIGKILL and SIGTERM) while jobs keep coming. Nothing is lost, duplicates stay within
what was uncommitted when work changed hands, the commit lag ends at 0, and every partition ends
up owned by exactly one of the last workers, none paused. Runs `tokenmill chaos rebalance-storm`'s
scenario against the session's broker."""

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_a_rebalance_storm_loses_nothing_and_leaves_no_partition_behind(kafka_bootstrap, tiny_llama_dir,
                                                                              tmp_path, monkeypatch):
    from tests import worker_launcher
    from tokenmill.tools.chaos import fleet
    from tokenmill.tools.chaos.scenarios import ChaosConfig, run_scenario

    # The storm's workers forked from a process that has imported torch (worker_launcher.py says why).
    monkeypatch.setattr(fleet, "start_process", worker_launcher.start_process)

    config = ChaosConfig("rebalance-storm", jobs=3000, max_tokens=4, partitions=8, schedule=(1, 4, 1, 3),
                         step_s=7.5, bootstrap=kafka_bootstrap, model=str(tiny_llama_dir), drain_timeout_s=120.0,
                         work_dir=tmp_path)
    report = await run_scenario(config)
    print("\n" + report.format())
    d = report.details
    assert report.lost == 0, report.lost_ids
    assert report.not_ok == 0 and report.commit_lag == 0 and report.drain_s is not None
    assert report.duplicated <= report.duplicate_bound, "more duplicates than was uncommitted when work moved"
    assert d["sizes"] == [1, 2, 3, 4, 3, 2, 1, 2, 3] and sum("SIGKILL" in s for s in d["steps"]) == 2
    assert report.unexpected_exits == [] and len(report.exit_codes) == 3
    assert set(report.exit_codes.values()) == {0}
    assert d["unowned_partitions"] == [] and d["shared_partitions"] == []
    assert d["assigned_partitions"] == 8 and d["paused_partitions"] == 0
