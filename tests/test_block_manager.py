"""Block pool, block tables and prefix cache: unit tests and a long random operation sequence."""

import random

import pytest

from tokenmill.engine.block_manager import BlockManager, BlockState, hash_block


def state(tokens, salt=b""):
    return BlockState(token_ids=list(tokens), salt=salt)


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert a != hash_block(None, [1, 2, 3, 4], salt=b"tenant-a")
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_allocate_gives_enough_slots_and_release_frees_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = state(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.allocate(s, 12)  # still fits the third block
    assert len(s.block_table) == 3
    assert bm.allocate(s, 13)
    assert len(s.block_table) == 4
    bm.check_invariants([s])
    bm.release(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    bm.check_invariants([])


def test_allocate_fails_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = state(range(12))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([s])


def test_prefix_hit_after_registration_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = state(range(12))
    assert bm.allocate(a, 12)
    bm.register_computed(a, 12)
    # Same 12 tokens: at most 11 may come from the cache, so only 2 full blocks hit.
    b = state(range(12))
    hit = bm.find_cached_prefix(b, len(b.token_ids) - 1)
    assert hit == a.block_table[:2]
    # A longer prompt with the same first 12 tokens hits all three blocks.
    c = state(list(range(12)) + [99, 98])
    assert bm.find_cached_prefix(c, 13) == a.block_table
    # A different middle block stops the chain there.
    d = state([0, 1, 2, 3, 7, 7, 7, 7, 8, 9, 10, 11, 5])
    assert bm.find_cached_prefix(d, 12) == a.block_table[:1]


def test_tenant_salt_prevents_cross_tenant_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = state(range(9), salt=b"alice")
    assert bm.allocate(a, 9)
    bm.register_computed(a, 9)
    assert bm.find_cached_prefix(state(range(9), salt=b"bob"), 8) == []
    assert bm.find_cached_prefix(state(range(9)), 8) == []
    assert len(bm.find_cached_prefix(state(range(9), salt=b"alice"), 8)) == 2


def test_shared_blocks_are_ref_counted_and_free_cached_blocks_revive():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = state(range(9))
    assert bm.allocate(a, 9)
    bm.register_computed(a, 9)
    b = state(range(9))
    hit = bm.find_cached_prefix(b, 8)
    assert bm.allocate(b, 9, hit)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.check_invariants([a, b])
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == 6
    # The cached blocks are free but still hittable; a hit takes them off the free list.
    c = state(range(9))
    hit = bm.find_cached_prefix(c, 8)
    assert len(hit) == 2
    assert bm.allocate(c, 9, hit)
    assert bm.num_free_blocks == 3
    bm.check_invariants([c])


def test_lru_hands_out_uncached_blocks_first_and_evicts_lazily():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = state([1, 2, 3, 4])
    assert bm.allocate(a, 4)
    bm.register_computed(a, 4)
    a_blocks = list(a.block_table)
    bm.release(a)
    # Two cached free blocks and two never-used ones: a new request takes the plain ones first.
    b = state([9, 9, 9, 9])
    assert bm.allocate(b, 4)
    assert set(b.block_table).isdisjoint(a_blocks)
    assert bm.num_evictions == 0
    assert len(bm.find_cached_prefix(state([1, 2, 3, 4, 5]), 4)) == 2
    # Now only the cached ones are left: taking one evicts its hash (tail block first).
    c = state([7, 7])
    assert bm.allocate(c, 2)
    assert bm.num_evictions == 1
    assert len(bm.find_cached_prefix(state([1, 2, 3, 4, 5]), 4)) == 1  # head block survived
    bm.check_invariants([b, c])


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = state([1, 2, 3, 4])
    assert bm.allocate(a, 4)
    bm.register_computed(a, 4)
    bm.release(a)
    s = state([1, 2, 3, 4, 5, 6, 7])
    hit = bm.find_cached_prefix(s, 6)
    assert len(hit) == 2
    # 7 tokens need 4 blocks; the pool has only 3.
    assert not bm.can_allocate(s, 7, hit)
    assert not bm.allocate(s, 7, hit)
    bm.check_invariants([s])
    assert bm.allocate(s, 6, hit)
    bm.check_invariants([s])


def test_duplicate_computation_keeps_one_cached_copy():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = state([1, 2, 3]), state([1, 2, 3])
    assert bm.allocate(a, 3) and bm.allocate(b, 3)
    bm.register_computed(a, 3)
    bm.register_computed(b, 3)
    assert len(bm.cached) == 1
    bm.check_invariants([a, b])
    bm.release(a)
    bm.release(b)
    bm.check_invariants([])


@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_leave_no_leak(caching):
    """>= 10,000 allocate / append / free / preempt operations, invariants checked throughout."""
    rng = random.Random(7 if caching else 8)
    bs = 4
    bm = BlockManager(num_blocks=64, block_size=bs, enable_prefix_caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 20))] for _ in range(5)]
    live: list[tuple[BlockState, int]] = []  # (state, tokens with slots)
    ops = 0
    counts = {"allocate": 0, "append": 0, "free": 0, "preempt": 0}
    while ops < 12_000:
        op = rng.random()
        if op < 0.3 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
            s = BlockState(token_ids=tokens, salt=rng.choice([b"", b"t1"]))
            hit = bm.find_cached_prefix(s, len(tokens) - 1)
            if bm.allocate(s, len(tokens), hit):
                bm.register_computed(s, len(tokens))
                live.append((s, len(tokens)))
            counts["allocate"] += 1
        elif op < 0.75:
            i = rng.randrange(len(live))
            s, n = live[i]
            s.token_ids.append(rng.randrange(50))
            if bm.allocate(s, n + 1):
                bm.register_computed(s, n + 1)
                live[i] = (s, n + 1)
            else:
                s.token_ids.pop()
            counts["append"] += 1
        elif op < 0.9:
            s, _ = live.pop(rng.randrange(len(live)))
            bm.release(s)
            counts["free"] += 1
        else:
            # Preempt: release, then recompute from the cache as the scheduler does.
            i = rng.randrange(len(live))
            s, n = live[i]
            bm.release(s)
            hit = bm.find_cached_prefix(s, n - 1)
            if bm.allocate(s, n, hit):
                bm.register_computed(s, n)
            else:
                live.pop(i)
            counts["preempt"] += 1
        ops += 1
        if ops % 200 == 0:
            bm.check_invariants([s for s, _ in live])
    bm.check_invariants([s for s, _ in live])
    for s, _ in live:
        bm.release(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    assert all(r == 0 for r in bm.ref_counts)
    assert all(v > 500 for v in counts.values()), counts
    if caching:
        assert bm.cached, "the prefix cache was never used"
