"""Fair admission without a broker: a bounded number of jobs in the engine, the rest handed over
round-robin across tenants (priority first), tenant caps passed over, and the stated bound on how
long a small tenant waits behind a big backlog."""

from __future__ import annotations

from collections import deque

import pytest

from tokenmill.kafka.tenants import TenantLimiter


def _drain_order(lim: TenantLimiter, started: list, steps: int) -> list:
    """Release the oldest started item `steps` times; returns what started, in order."""
    order = []
    running = deque(started)
    for _ in range(steps):
        tenant, _ = running.popleft()
        nxt = lim.release(tenant)
        if nxt is not None:
            order.append(nxt)
            running.append(nxt)
    return order


def test_held_jobs_go_to_the_engine_round_robin_across_tenants():
    lim = TenantLimiter(0, max_in_engine=2)
    started = [item for item in [("big", i) for i in range(6)] + [("small", i) for i in range(2)]
               + [("mid", 0)] if lim.admit(item[0], item)]
    assert started == [("big", 0), ("big", 1)] and lim.held == 7 and lim.in_engine == 2
    order = _drain_order(lim, started, 9)
    assert order == [("big", 2), ("small", 0), ("mid", 0), ("big", 3), ("small", 1), ("big", 4), ("big", 5)]
    assert lim.held == 0 and lim.in_engine == 0 and lim.running("big") == 0


def test_jobs_without_a_tenant_take_their_turn_as_one_more_tenant():
    lim = TenantLimiter(0, max_in_engine=1)
    for item in [("a", 0), ("a", 1), (None, 0), (None, 1), ("a", 2)]:
        lim.admit(item[0], item)
    assert _drain_order(lim, [("a", 0)], 4) == [("a", 1), (None, 0), ("a", 2), (None, 1)]


def test_a_lower_priority_value_goes_first_whatever_the_turn():
    priority = {("a", 1): 0, ("a", 2): 0, ("b", 0): 5, ("b", 1): -1, ("c", 0): 0}
    lim = TenantLimiter(0, max_in_engine=1, priority_of=lambda item: priority.get(item, 0))
    for item in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)]:
        lim.admit(item[0], item)
    # b's urgent job first; then a and c in turn at priority 0; b's priority 5 job last.
    assert _drain_order(lim, [("a", 0)], 5) == [("b", 1), ("a", 1), ("c", 0), ("a", 2), ("b", 0)]


def test_a_tenant_at_its_cap_is_passed_over_until_one_of_its_jobs_leaves():
    lim = TenantLimiter(1, max_in_engine=3)
    assert lim.admit("a", "a0") and not lim.admit("a", "a1") and lim.admit("b", "b0") and lim.admit("c", "c0")
    assert not lim.admit("b", "b1") and not lim.admit("d", "d0")  # the engine is full
    assert lim.release("c") == "d0"  # a and b are at their cap: d, next in turn after them, goes
    assert lim.release("d") is None  # a and b still at their cap; the place stays free
    assert lim.in_engine == 2 and lim.admit("e", "e0")  # a free place is taken at once
    assert lim.release("a") == "a1" and lim.release("b") == "b1" and lim.held == 0


def test_without_an_engine_bound_only_the_tenant_caps_hold_jobs():
    lim = TenantLimiter(2)
    assert all(lim.admit("t", i) for i in range(2)) and not lim.admit("t", 2)
    assert all(lim.admit(None, i) for i in range(500)) and lim.held == 1
    assert lim.release("t") == 2


def test_dropping_held_jobs_keeps_the_turn_of_the_rest():
    lim = TenantLimiter(0, max_in_engine=1)
    for item in [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("a", 2)]:
        lim.admit(item[0], item)
    assert lim.drop_held(lambda item: item[0] == "b") == [("b", 0)]
    assert lim.held == 3 and lim.held_of("b") == 0
    assert _drain_order(lim, [("a", 0)], 3) == [("a", 1), ("c", 0), ("a", 2)]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="engine"):
        TenantLimiter(0, max_in_engine=-1)


def test_the_stated_bound_holds_for_a_small_tenant_behind_a_big_backlog():
    """The engine modelled as FIFO, max_num_seqs at a time: with 2 tenants, the small tenant's
    last job finishes within max_in_engine + 2 x its job count completions after it was fetched."""
    max_num_seqs, bound, n_small = 64, 128, 10
    lim = TenantLimiter(0, max_in_engine=bound)
    engine: deque = deque()
    for i in range(2000):
        if lim.admit("big", ("big", i)):
            engine.append(("big", i))
    fetched_at_completion = 0
    finished: list = []

    def complete(n: int) -> None:
        for _ in range(n):
            tenant, i = engine.popleft()
            finished.append((tenant, i))
            nxt = lim.release(tenant)
            if nxt is not None:
                engine.append(nxt)

    complete(max_num_seqs)  # the backlog is running when the small tenant's jobs arrive
    fetched_at_completion = len(finished)
    for i in range(n_small):
        if lim.admit("small", ("small", i)):
            engine.append(("small", i))
    for i in range(2000, 4000):
        lim.admit("big", ("big", i))
    while engine:
        complete(min(max_num_seqs, len(engine)))
    last_small = max(rank for rank, (tenant, _) in enumerate(finished, 1) if tenant == "small")
    assert last_small - fetched_at_completion <= bound + 2 * n_small
    assert len(finished) == 4010


def test_the_engine_bound_flag_and_its_default():
    from tokenmill.cli import build_parser
    from tokenmill.cli.commands.worker import settings_from_args

    def settings(*extra):
        return settings_from_args(build_parser().parse_args(
            ["worker", "--bootstrap-servers", "h:1", "--model", "/m", "--max-num-seqs", "8", *extra]))

    assert settings().max_engine_jobs is None and settings().engine_jobs_bound() == 16
    assert settings("--max-engine-jobs", "5").engine_jobs_bound() == 5
    assert settings("--max-engine-jobs", "0").engine_jobs_bound() == 0
    with pytest.raises(ValueError, match="max-engine-jobs"):
        settings("--max-engine-jobs", "-2")
