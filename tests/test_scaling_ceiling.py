"""tools/scaling_ceiling.py: the machine's ceiling beside the engine's own scaling."""

from __future__ import annotations

import json
import os

import pytest

from tokenmill.tools.scaling_ceiling import ceiling_ratios, format_report, main, meet, run_once
from tokenmill.tools.tiny_models import cached_tiny_model


def _run(wall_s: float, started_at: float = 100.0) -> dict:
    return {"wall_s": wall_s, "started_at": started_at}


def test_a_pair_as_fast_as_one_alone_is_a_ceiling_of_two():
    runs = {"alone_first": _run(10.0), "alone_second": _run(10.4), "pair": [_run(10.2), _run(10.2)],
            "t1": _run(10.0), "t2": _run(5.5)}
    r = ceiling_ratios(runs)
    assert r["ceiling"] == pytest.approx(2.0)
    assert r["engine_scaling"] == pytest.approx(10.0 / 5.5)
    assert r["share_of_ceiling"] == pytest.approx(10.0 / 5.5 / 2.0)
    assert r["pair_overlap"] == pytest.approx(1.0)


def test_a_pair_that_takes_twice_as_long_leaves_no_room_for_a_second_thread():
    runs = {"alone_first": _run(10.0), "alone_second": _run(10.0), "pair": [_run(19.0), _run(21.0)],
            "t1": _run(10.0), "t2": _run(9.0)}
    r = ceiling_ratios(runs)
    assert r["ceiling"] == pytest.approx(1.0)
    assert r["share_of_ceiling"] == pytest.approx(10.0 / 9.0)


def test_the_overlap_of_the_pair_counts_only_the_time_both_ran():
    # One ran 100-110, the other 105-115: they shared 5 s of a 10 s run.
    runs = {"alone_first": _run(10.0), "alone_second": _run(10.0), "pair": [_run(10.0, 100.0), _run(10.0, 105.0)],
            "t1": _run(10.0), "t2": _run(5.0)}
    assert ceiling_ratios(runs)["pair_overlap"] == pytest.approx(0.5)
    apart = {**runs, "pair": [_run(10.0, 100.0), _run(10.0, 120.0)]}
    assert ceiling_ratios(apart)["pair_overlap"] == 0.0


def test_the_report_names_each_run_and_both_ratios():
    runs = {"alone_first": _run(10.0), "alone_second": _run(10.0), "pair": [_run(11.0), _run(11.0)],
            "t1": _run(10.0), "t2": _run(5.5)}
    result = {"model": "tiny-llama", "num_requests": 256, "cpus": [0, 1], "runs": runs, **ceiling_ratios(runs)}
    text = format_report(result)
    assert "pair 11.00 / 11.00 s" in text and "2 threads 5.50 s" in text
    assert "ceiling (two pinned one-thread runs at once against one alone): 1.82x" in text
    assert "engine from 1 to 2 threads: 1.82x, 100% of the ceiling" in text


def test_one_run_reports_its_wall_time_and_every_requested_token():
    run = run_once("tiny-llama", threads=1, num_requests=4, kv_cache_gb=0.25)
    assert run["wall_s"] > 0 and run["output_tokens"] > 0 and run["threads"] == 1
    assert run["cpus"] == sorted(os.sched_getaffinity(0))


def test_a_pair_run_waits_for_its_partner_and_gives_up_on_one_that_never_comes(tmp_path):
    meet(tmp_path, 1)  # alone: ready at once
    assert len(list(tmp_path.glob("ready-*"))) == 1
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    with pytest.raises(TimeoutError, match="2 processes were not ready"):
        meet(lonely, 2, timeout_s=0.05)
    partnered = tmp_path / "partnered"
    partnered.mkdir()
    (partnered / "ready-partner").touch()  # the other process got there first
    meet(partnered, 2, timeout_s=5.0)


def test_cpus_outside_the_process_mask_are_refused(capsys):
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as exc:
        main(["--cpus", "0", str(outside)])
    assert exc.value.code == 2
    assert "may run on CPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--num-requests", "0"])
    with pytest.raises(SystemExit):
        main(["--kv-cache-gb", "0"])


# Pins its runs to two CPUs and times them. It asserts what the probe ran and wrote, which holds on a
# loaded machine too (the pair's starts meet at a barrier); the figures it prints mean something only
# on an otherwise idle machine (run it alone for those).
@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe pins runs to two CPUs")
def test_the_probe_runs_each_part_pinned_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # The smallest test model: six processes each load it and time 3 requests (tiny-llama, the tool's
    # default, costs 5.0 CPU-s a process against 3.3; the figures are not what this test reads).
    model = str(cached_tiny_model("test-llama"))
    assert main(["--model", model, "--num-requests", "3", "--kv-cache-gb", "0.25", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert runs["alone_first"]["cpus"] == cpus[:1] and runs["alone_second"]["cpus"] == cpus[1:]
    assert sorted(r["cpus"][0] for r in runs["pair"]) == cpus
    assert runs["t1"]["threads"] == 1 and runs["t2"]["threads"] == 2 and runs["t2"]["cpus"] == cpus
    assert result["ceiling"] > 0 and result["engine_scaling"] > 0
    # The pair's timed runs started together, whatever their starts took.
    assert abs(runs["pair"][0]["started_at"] - runs["pair"][1]["started_at"]) < 0.5
    assert "machine's ceiling" in capsys.readouterr().out
