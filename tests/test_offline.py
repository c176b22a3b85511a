"""worker/offline.py: the one offline driver, tested against a scripted engine (no model)."""

import pytest

from tests.offline_helpers import ScriptedEngine
from tokenmill.offline import OfflineRunner
from tokenmill.schemas import Job


def job(i, prompt=None, **fields):
    return Job.model_validate({"job_id": f"j{i}", "prompt": prompt or f"prompt {i}", "metadata": {"i": i}, **fields})


def run_all(runner, jobs):
    """Feed every job while the window has room, step until all are answered: (tag, Result)."""
    answered, pending = [], list(enumerate(jobs))
    while pending or runner.in_flight:
        while pending and not runner.full:
            tag, j = pending.pop(0)
            refused = runner.add(j, tag)
            if refused is not None:
                answered.append((tag, refused))
        answered.extend(runner.step())
    return answered


def test_keeps_at_most_max_in_flight_and_answers_every_job_with_its_tag():
    engine = ScriptedEngine(max_num_seqs=2, steps=3)
    runner = OfflineRunner(engine, worker="offline-test", max_in_flight=3)
    answered = run_all(runner, [job(i) for i in range(10)])
    assert engine.peak == 3
    assert sorted(tag for tag, _ in answered) == list(range(10))
    for tag, result in answered:
        assert result.job_id == f"j{tag}" and result.status == "ok" and result.text == "xxx"
        assert result.model == "scripted" and result.worker == "offline-test"
        assert result.attempt.startswith("offline-test-") and result.metadata == {"i": tag}
    assert len({r.attempt for _, r in answered}) == 10


def test_the_window_defaults_to_four_times_max_num_seqs():
    assert OfflineRunner(ScriptedEngine(max_num_seqs=5), worker="w").max_in_flight == 20


def test_a_refused_request_is_answered_at_once_and_never_enters_the_window():
    engine = ScriptedEngine(refuse={"bad"})
    runner = OfflineRunner(engine, worker="w", max_in_flight=4)
    refused = runner.add(job(1, "bad"), "tag-1", attempt="w-given")
    assert refused is not None and runner.in_flight == 0
    assert (refused.status, refused.error.code, refused.attempt) == ("error", "invalid_job", "w-given")
    assert "refused" in refused.error.message and refused.metadata == {"i": 1}
    assert runner.add(job(2), "tag-2") is None and runner.in_flight == 1


def test_logprobs_are_taken_from_the_final_delta():
    runner = OfflineRunner(ScriptedEngine(steps=2), worker="w")
    [(_, result)] = run_all(runner, [job(0, sampling={"logprobs": 0})])
    assert [lp.logprob for lp in result.logprobs] == [-0.5, -0.5]


def test_an_outcome_the_contract_cannot_express_is_an_internal_error():
    runner = OfflineRunner(ScriptedEngine(), worker="w")
    [(_, result)] = run_all(runner, [job(0, "no logprobs", sampling={"logprobs": 0})])
    assert (result.status, result.error.code) == ("error", "internal")
    assert "logprobs" in result.error.message


def test_an_engine_that_stops_with_requests_inside_does_not_hang_the_run():
    runner = OfflineRunner(ScriptedEngine(drop=True), worker="w", max_in_flight=4)
    for i in range(3):
        assert runner.add(job(i), i) is None
    answered = runner.step()
    assert sorted(tag for tag, _ in answered) == [0, 1, 2] and runner.in_flight == 0
    assert {(r.status, r.error.code) for _, r in answered} == {("error", "internal")}
    assert runner.step() == []


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_full_tells_when_the_window_is_used_up(max_in_flight):
    runner = OfflineRunner(ScriptedEngine(), worker="w", max_in_flight=max_in_flight)
    for i in range(max_in_flight):
        assert not runner.full
        runner.add(job(i), i)
    assert runner.full
