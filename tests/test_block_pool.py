"""The host block pool: allocation, sharing, freeing, exhaustion and usage, never corrupted."""

import pytest
from hypothesis import given, settings, strategies as st

from jaxcb.core.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert 0 not in pool.allocate(4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_exhaustion_raises_a_typed_error_and_allocates_nothing():
    pool = BlockPool(6)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 3 KV cache blocks but only 2 are free") as info:
        pool.allocate(3)
    assert (info.value.requested, info.value.available) == (3, 2)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_double_free_is_refused_without_changing_the_pool():
    pool = BlockPool(6)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(BlockPoolError, match="is free"):
        pool.free(a)
    assert pool.num_free_blocks == 5
    pool.check_invariants()


def test_freeing_a_block_twice_in_one_call_is_refused_atomically():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    with pytest.raises(BlockPoolError, match="freed more times than it is held"):
        pool.free([a, b, a])
    assert pool.ref_count(a) == 1 and pool.ref_count(b) == 1


def test_null_and_unknown_blocks_are_refused():
    pool = BlockPool(4)
    with pytest.raises(BlockPoolError, match="null block"):
        pool.free([0])
    with pytest.raises(BlockPoolError, match="not in this pool"):
        pool.free([9])
    with pytest.raises(BlockPoolError, match="is free"):
        pool.fork([2])


def test_forked_blocks_are_freed_only_when_the_last_holder_frees_them():
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    pool.fork(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free_blocks == 2 and [pool.ref_count(b) for b in blocks] == [1, 1]
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_usage_counts_used_over_usable_blocks():
    pool = BlockPool(11)
    assert pool.usage().usage == 0.0
    pool.allocate(4)
    u = pool.usage()
    assert (u.num_used_blocks, u.num_free_blocks, u.num_usable_blocks) == (4, 6, 10)
    assert u.usage == pytest.approx(0.4)


def test_free_queue_is_in_eviction_order_tail_blocks_first():
    pool = BlockPool(7)
    seq = pool.allocate(3)  # 1, 2, 3
    pool.allocate(3)  # 4, 5, 6
    pool.free(seq)
    # freed last-first: the sequence's tail is the first to be reused (evicted)
    assert [pool.allocate(1) for _ in range(3)] == [[3], [2], [1]]


def test_blocks_taken_together_come_ascending_whatever_their_eviction_order():
    pool = BlockPool(9)
    seq = pool.allocate(4)  # 1, 2, 3, 4
    pool.allocate(4)
    pool.free(seq)  # queued 4, 3, 2, 1
    # the same blocks the eviction order picks, handed out in memory order: a run read forwards
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(1) == [1]


# --- prefix caching --------------------------------------------------------------------------------

ROOT = ("model", None, None)  # a chain's root key, as the KV-cache manager makes it


def test_a_registered_block_is_found_only_with_its_tokens_and_its_parent():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    first = pool.register(a, b"h0", ROOT, [1, 2])
    second = pool.register(b, b"h1", first, [3, 4])
    assert pool.find(b"h0", ROOT, [1, 2]).block == a and pool.find(b"h1", first, (3, 4)).block == b
    assert pool.find(b"h0", ROOT, [1, 9]) is None  # the hash, other tokens
    assert pool.find(b"h0", ("model", "salt", None), [1, 2]) is None  # another root
    assert pool.find(b"h1", second, [3, 4]) is None  # another parent
    assert pool.find(b"h2", first, [3, 4]) is None
    pool.check_invariants()


def test_the_same_contents_registered_twice_are_cached_once_and_other_contents_under_a_hash_not_at_all():
    pool = BlockPool(6)
    a, twin, forged = pool.allocate(3)
    content = pool.register(a, b"h0", ROOT, [1, 2])
    assert pool.register(twin, b"h0", ROOT, [1, 2]) == content  # its children follow a's contents
    assert pool.content_id(twin) == content and not pool.is_registered(twin)
    assert pool.register(forged, b"h0", ROOT, [7, 7]) is None  # a collision: not cacheable
    assert pool.content_id(forged) is None and pool.find(b"h0", ROOT, [1, 2]).block == a
    pool.free([twin, forged])
    assert pool.content_id(twin) is None  # forgotten once free
    pool.check_invariants()


def test_a_cached_child_does_not_follow_its_parents_block_refilled_with_other_tokens():
    """A child names its parent's registration, never its block id: the parent evicted and its
    block registered again with other tokens under the same hash (a collision) is not its parent."""
    pool = BlockPool(3)
    parent, child = pool.allocate(2)
    old = pool.register(parent, b"h0", ROOT, [1, 2])
    pool.register(child, b"h1", old, [3, 4])
    pool.free([parent])
    pool.free([child])  # both cached; the parent is evicted first
    assert pool.allocate(1) == [parent] and pool.num_evictions == 1
    new = pool.register(parent, b"h0", ROOT, [5, 6])
    assert new != old and pool.find(b"h1", new, [3, 4]) is None
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "fork", "free"]), st.integers(0, 6)), max_size=60))
def test_random_operation_sequences_never_leak_or_corrupt(ops):
    pool = BlockPool(9)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            try:
                held.append(pool.allocate(n))
            except NoFreeBlocksError:
                assert n > pool.num_free_blocks
        elif op == "fork" and held:
            held.append(pool.fork(held[n % len(held)]))
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        pool.check_invariants()
    for blocks in held:
        pool.free(blocks)
    pool.check_invariants()
    assert pool.num_free_blocks == 8
