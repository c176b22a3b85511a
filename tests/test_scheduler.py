"""Scheduler: budgets, preemption order, priority, deadlines, prefix-aware admission (no model)."""

import random

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams


def make(rid, tokens, *, priority=0, arrival=0.0, deadline_ms=None, tenant=None, max_tokens=4):
    er = EngineRequest(
        request_id=rid, prompt_token_ids=list(tokens), sampling=SamplingParams(max_tokens=max_tokens),
        priority=priority, arrival_time=arrival, deadline_ms=deadline_ms, tenant=tenant,
    )
    return Request(er, list(tokens))


def sched(num_blocks=64, block_size=4, caching=True, clock=lambda: 0.0, **cfg):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**cfg), bm, clock=clock)


def run_step(s, out, finished_after=None):
    """Pretend the forward ran: mark computed, append one token to each request that sampled."""
    s.on_step_done(out)
    done = []
    for r in out.requests:
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(7)
            if r.num_output_tokens >= (finished_after or r.sampling.max_tokens):
                done.append(r)
    s.finish_many([(r, FinishReason.LENGTH) for r in done])
    return done


def test_chunked_prefill_and_decode_share_a_step_within_budget():
    s = sched(max_num_batched_tokens=10, block_size=4)
    a = make("a", range(3), arrival=0)
    b = make("b", range(100, 125), arrival=1)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [3, 7]  # b's prompt is chunked
    run_step(s, out)
    out = s.schedule()
    assert out.num_new_tokens == [1, 9]  # a decodes while b's prefill continues
    assert out.num_batched_tokens <= 10


def test_priority_then_arrival_and_max_num_seqs():
    s = sched(max_num_seqs=2)
    s.add(make("late-urgent", range(4), priority=-1, arrival=5))
    s.add(make("early", range(4), arrival=1))
    s.add(make("earliest-low", range(4), priority=3, arrival=0))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["late-urgent", "early"]
    assert s.num_waiting == 1


def test_preemption_takes_lowest_priority_newest_first_and_recomputes_from_cache():
    s = sched(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    a = make("a", range(8), arrival=0)
    b = make("b", range(50, 58), arrival=1)
    c = make("c", range(80, 87), priority=1, arrival=2)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert len(out.requests) == 3  # 2 + 2 + 2 blocks
    run_step(s, out)
    # a takes the last free block, b finds none: c (lowest priority, newest) is preempted.
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert [r.request_id for r in out.requests] == ["a", "b"]
    run_step(s, out)
    s.finish_many([(a, FinishReason.LENGTH), (b, FinishReason.LENGTH)])
    out = s.schedule()
    # c comes back and its first full block is a prefix-cache hit (its own, kept after preemption).
    assert out.requests == [c]
    assert c.num_computed_tokens == 4 and out.num_new_tokens == [4]
    s.bm.check_invariants([r.kv for r in s.running])


def test_deadline_expires_only_requests_not_started():
    now = [1000.0]
    s = sched(clock=lambda: now[0], max_num_seqs=1)
    first = make("first", range(4), arrival=0, deadline_ms=1_000_500)
    late = make("late", range(4), arrival=1, deadline_ms=1_000_500)
    s.add(first)
    s.add(late)
    out = s.schedule()
    assert out.requests == [first]
    run_step(s, out)
    now[0] = 1001.0  # both deadlines are past now
    out = s.schedule()
    assert out.expired == [late] and late.finish_reason is FinishReason.EXPIRED
    assert out.requests == [first]  # already started: it runs on


def test_prefix_group_warms_the_cache_once():
    s = sched(num_blocks=512, block_size=4, max_num_batched_tokens=4096)
    prefix = list(range(64))
    reqs = [make(f"r{i}", prefix + [1000 + i, 2000 + i], arrival=i) for i in range(10)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert out.requests == [reqs[0]]  # the others wait for the shared prefix to be computed
    run_step(s, out)
    out = s.schedule()
    assert set(out.requests[1:]) == set(reqs[1:])
    assert all(r.num_cached_prompt_tokens == 64 for r in reqs[1:])
    assert sum(out.num_new_tokens[1:]) == 9 * 2


def test_cache_hit_order_does_not_starve_a_request_without_hits():
    s = sched(num_blocks=512, block_size=4, max_num_seqs=1, max_defer_steps=3)
    prefix = list(range(40))
    warm = make("warm", prefix + [1], arrival=0)
    s.add(warm)
    run_step(s, s.schedule(), finished_after=1)
    cold = make("cold", range(500, 510), arrival=1)
    s.add(cold)
    admitted_at = None
    for step in range(12):
        # A steady stream of newer requests that hit the cache would always sort before `cold`.
        s.add(make(f"hot{step}", prefix + [2, step], arrival=2 + step))
        out = s.schedule()
        if cold in out.requests:
            admitted_at = step
            break
        run_step(s, out, finished_after=1)
    assert admitted_at is not None and admitted_at <= 4


def test_tenants_do_not_share_cache_or_wait_on_each_other():
    s = sched(num_blocks=512, block_size=4, max_num_batched_tokens=4096)
    a = make("a", range(40), tenant="alice")
    b = make("b", range(40), tenant="bob", arrival=1)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.requests == [a, b]  # no shared hashes: b is not held back
    run_step(s, out)
    c = make("c", range(40), tenant="bob", arrival=2)
    s.add(c)
    out = s.schedule()
    assert c in out.requests and c.num_cached_prompt_tokens == 36


def test_random_workload_respects_budgets_and_leaks_nothing():
    rng = random.Random(3)
    budget, max_seqs = 48, 12
    s = sched(num_blocks=40, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    prefixes = [[rng.randrange(30) for _ in range(rng.randint(0, 24))] for _ in range(4)]
    added = finished = steps = preemptions = 0
    while added < 300 or s.has_work():
        if added < 300 and rng.random() < 0.5:
            toks = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randint(1, 30))]
            s.add(make(f"q{added}", toks, priority=rng.randint(0, 2), arrival=added,
                       max_tokens=rng.randint(1, 20), tenant=rng.choice([None, "t"])))
            added += 1
        if rng.random() < 0.03 and s.running:  # abort one (the engine does it between steps)
            s.finish(rng.choice(s.running), FinishReason.ABORTED)
            finished += 1
        out = s.schedule()
        preemptions += len(out.preempted)
        assert out.num_batched_tokens <= budget
        assert len(out.requests) <= max_seqs and len(s.running) <= max_seqs
        assert len(set(map(id, out.requests))) == len(out.requests)
        for r, n in zip(out.requests, out.num_new_tokens, strict=True):
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_table) * 4 >= r.num_computed_tokens + n
        finished += len(run_step(s, out))
        steps += 1
        assert steps < 20_000
        if steps % 50 == 0:
            s.bm.check_invariants([r.kv for r in s.running + s.waiting])
    assert finished == 300
    assert preemptions > 0
    s.bm.check_invariants([])
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_finish_takes_a_request_out_frees_its_blocks_and_names_it_in_the_next_output():
    s = sched(num_blocks=16, block_size=4, max_num_seqs=1)
    running = make("running", range(8))
    waiting = make("waiting", range(20, 28), arrival=1)
    s.add(running)
    s.add(waiting)
    out = s.schedule()
    assert out.requests == [running] and s.waiting == [waiting] and out.finished == []
    s.finish(running, FinishReason.ABORTED)
    s.finish(waiting, FinishReason.ABORTED)
    for r in (running, waiting):
        assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORTED
        assert r.block_table == []
    assert not s.running and not s.waiting and not s.has_work()
    assert s.bm.num_free_blocks == s.bm.num_blocks
    out = s.schedule()
    assert out.finished == [running, waiting] and out.is_empty
    assert s.schedule().finished == []  # named once


def test_finish_many_ends_running_requests_in_one_pass_and_keeps_the_others():
    s = sched(num_blocks=64, block_size=4)
    reqs = [make(f"r{i}", range(10 * i, 10 * i + 5), arrival=i) for i in range(5)]
    for r in reqs:
        s.add(r)
    run_step(s, s.schedule(), finished_after=100)
    s.finish_many([(reqs[1], FinishReason.STOP), (reqs[3], FinishReason.LENGTH)])
    assert s.running == [reqs[0], reqs[2], reqs[4]]
    assert [r.finish_reason for r in reqs] == [None, FinishReason.STOP, None, FinishReason.LENGTH, None]
    s.bm.check_invariants([r.kv for r in s.running])
    assert s.schedule().finished == [reqs[1], reqs[3]]


def test_a_request_the_scheduler_never_held_can_be_finished():
    s = sched()
    refused = make("refused", range(4))  # e.g. a prompt too long: never added
    s.finish(refused, FinishReason.ERROR)
    assert refused.status is RequestStatus.FINISHED and refused.finish_reason is FinishReason.ERROR
    assert s.schedule().finished == [refused]


def test_expired_requests_are_finished_and_named_in_the_same_output():
    s = sched(clock=lambda: 10.0)
    late = make("late", range(4), deadline_ms=1.0)
    s.add(late)
    out = s.schedule()
    assert out.expired == [late] and out.finished == [late] and out.is_empty
    assert late.status is RequestStatus.FINISHED and not s.has_work()


def test_a_preempted_request_is_named_in_the_output_and_keeps_running_later():
    s = sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make("a", range(7), arrival=0)
    b = make("b", range(50, 57), arrival=1)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule(), finished_after=100)
    run_step(s, s.schedule(), finished_after=100)  # 8 + 8 tokens: both full
    out = s.schedule()  # a needs a third block: b goes back to waiting
    assert out.preempted == [b] and b.status is RequestStatus.WAITING and out.finished == []
