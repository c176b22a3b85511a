"""tools/profile_step.py: exclusive part timers that add up to the run, and the table they make."""

from __future__ import annotations

import json
import time

import pytest

from tokenmill.tools.profile_step import PARTS, PartTimer, format_table, profile_once


def test_a_part_called_inside_another_counts_only_for_itself():
    timer = PartTimer()
    inner = timer.wrap("inner", lambda: time.sleep(0.02))

    def outer_body():
        time.sleep(0.01)
        inner()
        time.sleep(0.01)

    outer = timer.wrap("outer", outer_body)
    t0 = time.perf_counter()
    outer()
    wall = time.perf_counter() - t0
    assert timer.seconds["inner"] == pytest.approx(0.02, abs=0.01)
    assert timer.seconds["outer"] == pytest.approx(0.02, abs=0.01)
    assert timer.seconds["inner"] + timer.seconds["outer"] == pytest.approx(wall, abs=1e-3)
    assert timer.calls == {"inner": 1, "outer": 1}


def test_a_part_can_be_named_by_where_it_is_called_from():
    timer = PartTimer()
    leaf = timer.wrap(lambda parents: "in b" if "b" in parents else "elsewhere", lambda: None)
    timer.wrap("b", leaf)()
    leaf()
    assert timer.calls["in b"] == 1 and timer.calls["elsewhere"] == 1


@pytest.mark.slow
def test_a_profile_of_the_mixed_workload_accounts_for_its_wall_time():
    run = profile_once("tiny-llama", threads=1, num_requests=6)
    parts = run["parts_s"]
    assert set(parts) == set(PARTS)
    # Every part that a step has was seen, and together they are the timed run.
    for part in ("scheduling", "step inputs", "GEMM", "LM head", "decode attention", "prefill attention",
                 "KV write", "element-wise", "sampling", "detokenize", "take-in, other", "step, other"):
        assert parts[part] > 0, part
    assert sum(parts.values()) == pytest.approx(run["timed_wall_s"], rel=0.02)
    assert run["output_tokens"] > 0 and run["steps"] > 0
    table = format_table([run, {**run, "threads": 2}])
    assert "| LM head |" in table and "speed-up 1->2" in table and "1.00x" in table
    # The child process hands its run to the parent as JSON; the timed run's decode steps were
    # timed on the Python layers even where the engine runs them in C (the kernels' rows above).
    assert json.loads(json.dumps(run))["model"] == "tiny-llama"
    assert ("(decode layers in C)" in table) == run["decode_layers_in_c"]
