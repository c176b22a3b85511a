"""Paged KV cache bookkeeping: the block pool, per-request block tables and the prefix cache.

The KV cache is a pool of `num_blocks` fixed-size blocks of `block_size` token slots. A request owns
an ordered block table; token i of the request lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix cache (the vLLM v1 design, written for this project):
- Every FULL block of a request's tokens gets a chained hash: sha256(parent hash, the block's token
  ids, the tenant salt). Equal hashes mean equal token prefixes (for the same tenant), so a block
  with that hash holds exactly the K/V a new request would compute.
- A block is registered under its hash once its tokens have been computed. Lookup at admission walks
  a request's hashes from the first block and stops at the first miss.
- Blocks carry reference counts. A block whose count drops to 0 goes to the free list but keeps its
  hash: it can still be hit, and a hit takes it back off the free list. Eviction is lazy: a cached
  block loses its hash only when the free list hands it out for new tokens.
- The free list is an LRU: blocks without a hash are handed out first, then cached blocks in the
  order they were freed (a request's tail blocks before its head blocks, since heads are shared more).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes = b"") -> BlockHash:
    """Chained hash of one full block. A cryptographic hash, so tenants cannot forge collisions."""
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class BlockState:
    """What the block manager needs to know about one request (embedded in the engine's Request)."""

    token_ids: list[int]  # all tokens of the request so far (prompt + output), appended in place
    salt: bytes = b""  # tenant salt: hashes of different tenants never match
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids computed so far (grown lazily, never shrunk:
    # token ids only ever get appended, so a full block's hash never changes).
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table already entered in the cache

    def update_hashes(self, block_size: int, upto_tokens: int | None = None) -> list[BlockHash]:
        """Extend block_hashes to cover every full block of the first `upto_tokens` tokens."""
        n = len(self.token_ids) if upto_tokens is None else upto_tokens
        full = n // block_size
        hashes = self.block_hashes
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size], self.salt))
        return hashes


class BlockManager:
    """Allocates KV blocks to requests and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> block id holding those tokens' K/V
        # Free blocks in eviction order (front is handed out first). OrderedDict gives O(1)
        # removal from the middle, which a prefix hit on a free cached block needs.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Counters for stats.
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, state: BlockState, num_tokens: int) -> int:
        """New blocks the request needs so that its first `num_tokens` tokens have slots."""
        need = -(-num_tokens // self.block_size) - len(state.block_table)
        return need if need > 0 else 0

    def find_cached_prefix(self, state: BlockState, max_tokens: int) -> list[int]:
        """Blocks of the longest cached prefix of the request's tokens, at most `max_tokens` tokens.

        The caller passes num_tokens - 1 as the cap: the last token is always recomputed, because
        its forward pass produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = state.update_hashes(self.block_size)
        limit = min(len(hashes), max_tokens // self.block_size)
        hit: list[int] = []
        cached = self.cached
        for i in range(limit):
            block = cached.get(hashes[i])
            if block is None:
                break
            hit.append(block)
        return hit

    def count_cached_prefix_blocks(self, state: BlockState, max_tokens: int) -> int:
        return len(self.find_cached_prefix(state, max_tokens))

    # ------------------------------------------------------------------ changes
    def can_allocate(self, state: BlockState, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether allocate(state, num_tokens, cached_blocks) would succeed."""
        need = -(-num_tokens // self.block_size) - len(state.block_table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)  # they leave the free list
        return max(need, 0) + revived <= len(self.free)

    def allocate(self, state: BlockState, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give the request slots for its first `num_tokens` tokens; False (and no change) if short.

        `cached_blocks` (from find_cached_prefix, only for a request with an empty block table) are
        shared first; then fresh blocks from the free list cover the rest.
        """
        if not cached_blocks and num_tokens <= len(state.block_table) * self.block_size:
            return True  # the table holds them already: most decode steps, every step of the batch
        if cached_blocks and state.block_table:
            raise ValueError("cached prefix blocks can only start an empty block table")
        if not self.can_allocate(state, num_tokens, cached_blocks):
            return False
        refs = self.ref_counts
        free = self.free
        table = state.block_table
        for b in cached_blocks:
            if refs[b] == 0:
                del free[b]
            refs[b] += 1
            table.append(b)
        if cached_blocks:
            state.num_registered_blocks = len(table)
        need = -(-num_tokens // self.block_size) - len(table)
        for _ in range(need):
            table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        """The front of the free list, for new tokens (referenced once)."""
        b, _ = self.free.popitem(last=False)
        old = self.block_hash[b]
        if old is not None:  # lazy eviction: the block's cached content is overwritten now
            if self.cached.get(old) == b:
                del self.cached[old]
            self.block_hash[b] = None
            self.num_evictions += 1
        self.ref_counts[b] = 1
        return b

    def can_fork(self, num_tokens: int) -> bool:
        """Whether fork(..., num_tokens) finds the block it may need for the copy."""
        return num_tokens % self.block_size == 0 or bool(self.free)

    def fork(self, parent: BlockState, child: BlockState, num_tokens: int) -> tuple[int, int] | None:
        """Give `child` (empty block table, the same first `num_tokens` tokens) the parent's K/V of
        them: full blocks shared by reference, the last partly filled block as a fresh block whose
        contents the caller copies (see can_fork). Returns (source, destination) of that copy, or
        None when the tokens fill whole blocks."""
        if not self.can_fork(num_tokens):
            raise ValueError("no free block for the forked request's last block")
        if child.block_table:
            raise ValueError("a fork starts an empty block table")
        bs = self.block_size
        full, partial = divmod(num_tokens, bs)
        if len(parent.block_table) < full + (1 if partial else 0):
            raise ValueError(f"the parent holds {len(parent.block_table)} blocks, {num_tokens} tokens need more")
        refs = self.ref_counts
        for b in parent.block_table[:full]:
            refs[b] += 1
            child.block_table.append(b)
        # The shared blocks' hashes are the parent's (the same tokens); they are registered by it.
        child.block_hashes = list(parent.update_hashes(bs, full * bs)[:full])
        child.num_registered_blocks = 0
        if not partial:
            return None
        dst = self._take_free_block()
        child.block_table.append(dst)
        return parent.block_table[full], dst

    def register_computed(self, state: BlockState, num_computed_tokens: int) -> None:
        """Enter the request's full blocks whose tokens are now computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed_tokens // self.block_size, len(state.block_table))
        if full <= state.num_registered_blocks:
            return
        hashes = state.update_hashes(self.block_size, full * self.block_size)
        table = state.block_table
        for i in range(state.num_registered_blocks, full):
            h = hashes[i]
            b = table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
            # else: another request computed the same tokens first; this copy stays unregistered
            # and returns to the free list as a plain block when released.
        state.num_registered_blocks = full

    def release(self, state: BlockState) -> None:
        """Drop the request's references (finish or preemption). Cached blocks stay hittable."""
        refs = self.ref_counts
        free = self.free
        block_hash = self.block_hash
        # Tail first, so that among blocks freed together the head (most shared) is evicted last.
        for b in reversed(state.block_table):
            refs[b] -= 1
            if refs[b] == 0:
                free[b] = None
                if block_hash[b] is None:
                    free.move_to_end(b, last=False)  # nothing cached in it: hand it out first
            elif refs[b] < 0:
                raise AssertionError(f"block {b} released more often than allocated")
        state.block_table.clear()
        state.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents; only lookups stop hitting)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    # ------------------------------------------------------------------ checks (tests, debugging)
    def check_invariants(self, states: Sequence[BlockState] = ()) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent."""
        expected = [0] * self.num_blocks
        for s in states:
            for b in s.block_table:
                expected[b] += 1
        for b in range(self.num_blocks):
            in_free = b in self.free
            if self.ref_counts[b] < 0:
                raise AssertionError(f"block {b} has negative ref count")
            if in_free and self.ref_counts[b] != 0:
                raise AssertionError(f"block {b} is both free and referenced ({self.ref_counts[b]})")
            if not in_free and self.ref_counts[b] == 0:
                raise AssertionError(f"block {b} is neither free nor referenced (leaked)")
            if states and expected[b] != self.ref_counts[b]:
                raise AssertionError(f"block {b}: ref count {self.ref_counts[b]}, tables hold {expected[b]}")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"cache maps a hash to block {b}, which carries another hash")
        if sum(1 for h in self.block_hash if h is not None) != len(self.cached):
            raise AssertionError("a block carries a hash the cache does not map")
