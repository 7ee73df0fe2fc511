"""The KV-cache manager answers the scheduler's block questions; the scheduler asks nothing else."""

from __future__ import annotations

import ast
import inspect

import pytest

from jaxcb.core import scheduler as scheduler_module
from jaxcb.core.block_pool import BlockPool, NoFreeBlocksError
from jaxcb.core.kv_cache_manager import CachedPrefix, KVCacheManager
from jaxcb.core.sequence import Sequence
from jaxcb.sampling_params import SamplingParams

BLOCK = 4


def manager(num_blocks: int = 6, host_blocks: int = 0, **kw) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK, enable_prefix_caching=True,
                          host_pool=BlockPool(host_blocks) if host_blocks else None, **kw)


def seq(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))


def admitted(kv: KVCacheManager, s: Sequence, num_tokens: int) -> Sequence:
    """Admitted with its cached prefix and room for num_tokens, its share computed (as the scheduler does)."""
    prefix = kv.cached_prefix(s)
    kv.admit(s, prefix, num_tokens)
    s.num_computed_tokens = num_tokens
    kv.register_full_blocks(s, num_tokens)
    return s


def pool_state(pool: BlockPool) -> tuple:
    return (pool.num_free_blocks, [pool.ref_count(b) for b in range(1, pool.num_blocks)], pool.num_cached_blocks)


def test_blocks_for_tokens_round_up_and_count_what_a_sequence_lacks():
    kv = manager()
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    s = admitted(kv, seq("s", range(10, 16)), 6)  # 2 blocks
    assert kv.num_blocks_needed(s, 8) == 0 and kv.num_blocks_needed(s, 9) == 1 and kv.num_blocks_needed(s, 17) == 3


def test_a_cached_prefix_counts_its_blocks_tokens_and_its_free_blocks_against_the_room_left():
    kv = manager(num_blocks=6)  # 5 usable blocks
    a = admitted(kv, seq("a", range(10, 19)), 9)  # 3 blocks, the first 2 full and cached
    kv.free(a)  # all 5 free, 2 of them caching a's prefix
    b = seq("b", list(range(10, 18)) + [1, 2, 3])
    prefix = kv.cached_prefix(b)
    assert prefix == CachedPrefix(tuple(a_blocks := prefix.block_ids), 8) and len(a_blocks) == 2
    assert kv.can_admit(prefix, 20)  # 5 blocks: its 2 cached ones and 3 of the other 3 free
    assert not kv.can_admit(prefix, 21)  # a 6th would have to be one of the prefix's own
    assert kv.can_admit(CachedPrefix(), 20) and not kv.can_admit(CachedPrefix(), 21)  # no prefix: 5 fresh


def test_admit_takes_the_prefix_then_fresh_blocks_or_nothing_at_all():
    kv = manager(num_blocks=6)
    a = admitted(kv, seq("a", range(10, 19)), 9)
    kv.free(a)
    b = seq("b", list(range(10, 18)) + [1, 2, 3])
    prefix = kv.cached_prefix(b)
    before = pool_state(kv.pool)
    with pytest.raises(NoFreeBlocksError):
        kv.admit(b, prefix, 21)
    assert pool_state(kv.pool) == before and b.block_ids == [] and kv.prefix_cache_hits == 0
    kv.admit(b, prefix, 11)
    assert b.block_ids[:2] == list(prefix.block_ids) and len(b.block_ids) == 3
    assert b.num_registered_blocks == 2 and kv.prefix_cache_hits == 8
    kv.pool.check_invariants()


def test_room_for_more_tokens_is_all_or_nothing():
    kv = manager(num_blocks=6)
    s = admitted(kv, seq("s", range(10, 14), max_tokens=20), 4)  # 1 block
    other = admitted(kv, seq("o", range(50, 58)), 8)  # 2 blocks: 2 left free
    before = (pool_state(kv.pool), list(s.block_ids))
    assert not kv.allocate(s, 9)  # 13 tokens: 3 more blocks
    assert (pool_state(kv.pool), s.block_ids) == before
    assert kv.allocate(s, 8) and len(s.block_ids) == 3 and kv.pool.num_free_blocks == 0
    assert kv.allocate(s, 4)  # no new block needed
    kv.free(s)
    kv.free(other)
    assert kv.pool.num_free_blocks == 5


def test_a_decoding_sequence_grows_by_a_run_only_while_enough_blocks_stay_free():
    kv = manager(num_blocks=12, block_growth=4, growth_reserve=4)
    s = admitted(kv, seq("s", range(10, 14), max_tokens=40), 4)  # 1 block, decoding from now on
    assert kv.allocate(s, 1) and len(s.block_ids) == 1 + 4  # a run of 4: 6 stay free
    kv2 = manager(num_blocks=8, block_growth=4, growth_reserve=4)
    t = admitted(kv2, seq("t", range(10, 14), max_tokens=40), 4)
    assert kv2.allocate(t, 1) and len(t.block_ids) == 2  # a run would leave 2 < 4 free: just the one


def test_preempting_swaps_the_computed_blocks_out_or_frees_them_and_registration_starts_over():
    kv = manager(num_blocks=8, host_blocks=4)  # 3 usable host blocks
    s = admitted(kv, seq("s", range(10, 19)), 9)  # 3 blocks, 2 registered
    device = list(s.block_ids)
    assert kv.preempt(s, swap=True)  # its 9 computed tokens' 3 blocks: the host takes them
    assert s.block_ids == [] and len(s.host_block_ids) == 3 and s.num_registered_blocks == 0
    host = list(s.host_block_ids)
    assert kv.take_swaps() == ([], list(zip(device, host)))
    assert kv.can_admit(CachedPrefix(), 10)
    kv.swap_in_blocks(s, 10)  # its 9 tokens and the next: 3 fresh device blocks, the host's copied in
    assert kv.take_swaps() == (list(zip(host, s.block_ids)), []) and s.host_block_ids == []
    assert len(s.block_ids) == 3 and kv.host_pool.num_free_blocks == 3

    t = admitted(kv, seq("t", range(30, 42)), 12)  # 3 blocks
    assert not kv.preempt(s, swap=False) and s.block_ids == []  # recompute: freed
    kv.host_pool.allocate(1)  # the host pool cannot take t's 3 blocks any more
    assert not kv.preempt(t, swap=True) and t.block_ids == [] and t.host_block_ids == []  # recompute instead
    assert kv.pool.num_free_blocks == 7 and kv.num_swap_outs == 1 and kv.num_swap_ins == 1
    kv.pool.check_invariants()


def _attribute_chain(node: ast.AST) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def test_the_scheduler_asks_the_kv_cache_manager_and_never_the_block_pool():
    """No call on a block pool, no read of its state, no block arithmetic: every block question
    goes through `self.kv`. (The `pool` property hands the pool to metrics and tests.)"""
    tree = ast.parse(inspect.getsource(scheduler_module))
    problems = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name == "pool":
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                chain = _attribute_chain(node)
                if any(name in ("pool", "block_pool", "host_pool", "block_size", "block_ids") for name in chain[:-1]):
                    problems.append(f"{fn.name}: {'.'.join(chain)}")
                if node.attr == "block_size":
                    problems.append(f"{fn.name}: {'.'.join(chain)}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                problems.append(f"{fn.name}: a floor division at line {node.lineno}")
            if isinstance(node, ast.Name) and node.id in ("block_pool", "block_size") and fn.name != "__init__":
                problems.append(f"{fn.name}: {node.id}")
    assert not problems, problems
