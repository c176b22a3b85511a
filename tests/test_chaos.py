"""`tokenmill chaos`: its pieces without a broker, its argument checks, and one short `kill` run
through the command line against the session's broker."""

import json
import subprocess
import sys

import pytest

from tests.worker_helpers import REPO
from tokenmill.tools.chaos.fleet import parse_metrics
from tokenmill.tools.chaos.ledger import ChaosTopics, Ledger, answer_of, make_jobs
from tokenmill.tools.chaos.scenarios import ChaosConfig, ChaosReport, storm_sizes


def test_a_storm_schedule_moves_one_worker_per_step():
    assert storm_sizes((1, 4, 1, 3)) == [1, 2, 3, 4, 3, 2, 1, 2, 3]
    assert storm_sizes((2, 2, 1)) == [2, 1]


def test_scenarios_that_restart_the_broker_refuse_a_given_one():
    with pytest.raises(ValueError, match="needs one it starts itself"):
        ChaosConfig("outage", bootstrap="kafka:9092").validate()
    with pytest.raises(ValueError, match="unknown scenario"):
        ChaosConfig("flood").validate()
    ChaosConfig("kill", bootstrap="kafka:9092").validate()
    with pytest.raises(ValueError, match="needs one it starts itself"):
        ChaosConfig("kill", bootstrap="kafka:9092", broker_restarts=1).validate()
    with pytest.raises(ValueError, match="goes with the kill scenario"):
        ChaosConfig("rebalance-storm", broker_restarts=1).validate()


def test_metrics_text_is_read_with_labels():
    text = ('# HELP x\ntokenmill_uncommitted_offsets 12.0\n'
            'tokenmill_commit_lag{partition="3",topic="jobs"} 0.0\n')
    assert parse_metrics(text) == [("tokenmill_uncommitted_offsets", {}, 12.0),
                                   ("tokenmill_commit_lag", {"partition": "3", "topic": "jobs"}, 0.0)]


def test_the_report_says_what_was_lost_and_what_bounds_the_duplicates():
    report = ChaosReport("kill", 10, lost=1, duplicated=3, not_ok=0, drain_s=None, commit_lag=2,
                         duplicate_bound=7, duplicate_bound_departed=5, first_result_s=0.4)
    text = report.format()
    assert not report.ok and "JOBS LOST" in text and "3 (bound 7" in text and "drain" in text
    assert json.loads(json.dumps(report.to_json()))["duplicate_bound"] == 7


def test_a_worker_that_was_not_killed_and_exits_non_zero_fails_the_run():
    exits = {"w1": "killed", "w2": 0, "w3": 1, "w4": 0}
    report = ChaosReport("kill", 10, lost=0, duplicated=0, not_ok=0, drain_s=1.0, commit_lag=0,
                         duplicate_bound=0, duplicate_bound_departed=0, first_result_s=0.4, worker_exits=exits)
    text = report.format()
    assert not report.ok and report.failed_exits == {"w3": 1}
    assert "WORKER FAILED" in text and "w1: killed, w2: 0, w3: 1, w4: 0" in text
    exits["w3"] = 0
    assert report.ok and "-> OK" in report.format()


def test_the_jobs_include_seeded_sampled_ones_with_logprobs():
    jobs = make_jobs(40, 8, "run")
    sampled = [j for j in jobs if j["sampling"]["temperature"] > 0]
    assert sampled and all(j["sampling"]["seed"] is not None for j in sampled)
    assert any("logprobs" in j["sampling"] for j in sampled)
    assert any(j["stream"] for j in jobs) and len({j["job_id"] for j in jobs}) == 40


def test_a_job_answered_twice_must_repeat_its_answer_bit_for_bit():
    ledger = Ledger("b", ChaosTopics("j", "r", "t", "d", "g", 1))
    ok = {"status": "ok", "token_ids": [3, 4], "text": "ab", "finish_reason": "length",
          "logprobs": [{"token_id": 3, "logprob": -1.25}, {"token_id": 4, "logprob": -0.5}]}
    moved = {**ok, "logprobs": [{"token_id": 3, "logprob": -1.2500000000000002}, ok["logprobs"][1]]}
    ledger.answers = {"same": [answer_of(ok), answer_of({**ok, "worker": "w2", "attempt": "x"})],
                      "moved": [answer_of(ok), answer_of(moved)], "once": [answer_of(ok)]}
    assert ledger.duplicate_answers() == (2, ["moved"])
    report = ChaosReport("kill", 10, lost=0, duplicated=2, not_ok=0, drain_s=1.0, commit_lag=0, duplicate_bound=2,
                         duplicate_bound_departed=2, first_result_s=0.4, duplicated_jobs=2, duplicates_identical=1,
                         duplicates_differing_ids=["moved"])
    assert not report.ok and "DUPLICATES DIFFER" in report.format() and "1 of 2 jobs" in report.format()
    report.duplicates_identical, report.duplicates_differing_ids = 2, []
    assert report.ok and "-> OK" in report.format()


def _chaos(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "chaos", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_the_command_refuses_an_outage_on_a_broker_it_did_not_start():
    proc = _chaos("outage", "--bootstrap-servers", "127.0.0.1:1", timeout=60)
    assert proc.returncode == 2 and "leave out --bootstrap-servers" in proc.stderr


@pytest.mark.kafka
@pytest.mark.slow
def test_a_short_kill_run_through_the_command_line_loses_nothing(kafka_bootstrap, tiny_llama_dir, tmp_path):
    out = tmp_path / "report.json"
    proc = _chaos("kill", "--jobs", "400", "--workers", "2", "--kills", "1", "--max-tokens", "16",
                  "--bootstrap-servers", kafka_bootstrap, "--model", str(tiny_llama_dir), "--json", str(out),
                  "--drain-timeout", "120")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["commit_lag"] == 0 and report["unexpected_exits"] == []
    killed = report["details"]["kills"][0]["worker"]
    assert report["worker_exits"][killed] == "killed" and len(report["worker_exits"]) == 3
    assert all(code == 0 for name, code in report["worker_exits"].items() if name != killed)
    assert "worker exits" in proc.stdout
    assert len(report["details"]["kills"]) == 1 and report["duplicated"] <= report["duplicate_bound"]
    assert report["duplicates_identical"] == report["duplicated_jobs"], report["duplicates_differing_ids"]
    assert "chaos kill: 400 jobs -> OK" in proc.stdout and "duplicated" in proc.stdout
