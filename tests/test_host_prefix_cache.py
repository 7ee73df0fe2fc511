"""The prefix cache's host tier (cache.host_prefix_cache_gib): registered blocks the device evicts are copied to
host memory without the step waiting, found again by the same collision-proof lookup, and copied back into fresh
device blocks as cache hits -- with the same greedy outputs as without it, and nothing leaked in either pool."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_factory import generate_first_completions, make_engine
from jaxcb.config import ConfigError, compose_config
from jaxcb.core.block_hash import chain_hash
from jaxcb.core.block_pool import BlockPool, CachedBlock
from jaxcb.core.host_prefix_cache import HostPrefixCache
from jaxcb.core.kv_cache_manager import KVCacheManager
from jaxcb.core.sequence import Sequence
from jaxcb.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def entry(host_hash: bytes, tokens=(1, 2, 3, 4), parent="root", content_id=7) -> CachedBlock:
    return CachedBlock(block=3, block_hash=host_hash, parent=parent, token_ids=tuple(tokens), content_id=content_id)


def test_the_host_tier_is_an_lru_of_contents_checked_by_tokens_and_parent_not_by_hash_alone():
    tier = HostPrefixCache(3)  # 2 usable host blocks
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    host_a = tier.insert(entry(a, content_id=1))
    host_b = tier.insert(entry(b, (5, 6, 7, 8), content_id=2))
    assert {host_a, host_b} == {1, 2} and tier.insert(entry(a, content_id=9)) is None  # cached already
    assert tier.find(a, "root", (1, 2, 3, 4)).content_id == 1  # a hit makes a the most recent
    assert tier.find(a, "root", (1, 2, 3, 5)) is None and tier.find(a, "other", (1, 2, 3, 4)) is None  # a collision
    assert tier.insert(entry(c, (9, 9, 9, 9), content_id=3)) == host_b  # b, least recently used, goes
    assert tier.find(b, "root", (5, 6, 7, 8)) is None and tier.num_evictions == 1
    tier.hold([host_a])  # a is being read back: it cannot be reused until released
    tier.hold([tier.find(c, "root", (9, 9, 9, 9)).block])
    assert tier.insert(entry(bytes(16), content_id=4)) is None
    tier.release([host_a])
    assert tier.insert(entry(bytes(16), content_id=4)) == host_a
    tier.check_invariants()


def seq(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=4, temperature=0))


def run_to_full(kv: KVCacheManager, s: Sequence) -> Sequence:
    """Admitted with its cached prefix, its whole prompt computed and registered, then finished."""
    kv.admit(s, kv.cached_prefix(s), s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.register_full_blocks(s, s.num_tokens)
    kv.free(s)
    return s


def test_evicted_blocks_go_to_the_host_and_come_back_into_fresh_blocks_as_hits_with_their_chain():
    pool, tier = BlockPool(5), HostPrefixCache(9)  # 4 usable device blocks, 8 host blocks
    kv = KVCacheManager(pool, BLOCK, enable_prefix_caching=True, host_cache=tier)
    shared = list(range(100, 112))  # 3 full blocks
    a = run_to_full(kv, seq("a", shared + [1]))
    a_blocks = {cached.token_ids: cached for b in range(1, 5) if (cached := pool.cached_block(b)) is not None}
    assert len(a_blocks) == 3
    run_to_full(kv, seq("b", list(range(200, 215)) + [2]))  # needs all 4 device blocks: a's 3 are evicted
    restore, offload = kv.take_host_tier_copies()
    assert restore == [] and sorted(d for d, _ in offload) == sorted(c.block for c in a_blocks.values())
    assert kv.num_offloaded_blocks == 3 and tier.num_cached_blocks == 3

    c = seq("c", shared + [3, 4])
    prefix = kv.cached_prefix(c)
    assert prefix.num_tokens == 12 and prefix.block_ids == () and prefix.num_host_blocks == 3
    assert kv.can_admit(prefix, c.num_tokens)
    kv.admit(c, prefix, c.num_tokens)
    assert tier.num_held == 3  # until the runner has read them
    restore, offload = kv.take_host_tier_copies()
    assert [d for _, d in restore] == c.block_ids[:3] and tier.num_held == 0
    # b's blocks were evicted to make room: they went out as a's came back.
    assert len(offload) == 4 and not set(d for d, _ in offload) - set(range(1, 5))
    # The restored blocks are registered with the contents (and content ids) they came back with.
    for i, block in enumerate(c.block_ids[:3]):
        cached = pool.cached_block(block)
        original = a_blocks[tuple(shared[i * BLOCK:(i + 1) * BLOCK])]
        assert (cached.block_hash, cached.parent, cached.content_id) == (
            original.block_hash, original.parent, original.content_id)
    assert kv.prefix_cache_hits == 12 and kv.host_prefix_hits == 12
    kv.free(c)
    pool.check_invariants()
    tier.check_invariants()


def test_a_chain_found_partly_on_the_device_and_partly_on_the_host_links_by_content_id():
    pool, tier = BlockPool(6), HostPrefixCache(9)
    kv = KVCacheManager(pool, BLOCK, enable_prefix_caching=True, host_cache=tier)
    shared = list(range(100, 112))
    run_to_full(kv, seq("a", shared + [1]))  # blocks freed last-first: the tail is evicted before the head
    filler = seq("f", list(range(300, 308)) + [5])
    kv.admit(filler, kv.cached_prefix(filler), filler.num_tokens)  # takes 3 fresh blocks: a's tail and a spare
    kv.take_host_tier_copies()
    kv.free(filler)
    c = seq("c", shared + [9])
    prefix = kv.cached_prefix(c)
    assert prefix.num_tokens == 12 and 0 < len(prefix.block_ids) < 3, prefix
    assert [entry is None for _, entry in prefix.blocks] == sorted(entry is None for _, entry in prefix.blocks)[::-1]
    kv.admit(c, prefix, c.num_tokens)
    restore, _ = kv.take_host_tier_copies()
    assert len(restore) == prefix.num_host_blocks
    kv.free(c)
    pool.check_invariants()
    tier.check_invariants()


def test_host_tier_config_is_checked_by_name():
    with pytest.raises(ConfigError, match="cache.host_prefix_cache_gib=-1"):
        compose_config(["cache.host_prefix_cache_gib=-1"])
    with pytest.raises(ConfigError, match="cache.enable_prefix_caching=false"):
        compose_config(["cache.host_prefix_cache_gib=1", "cache.enable_prefix_caching=false"])
    with pytest.raises(ConfigError, match="speculative.method=draft with cache.host_prefix_cache_gib=1"):
        compose_config(["cache.host_prefix_cache_gib=1", "speculative.method=draft", "speculative.draft_model=tiny"])
    with pytest.raises(ConfigError, match="holds no"):
        make_engine("cache.host_prefix_cache_gib=0.0000001")


# A device cache of 23 blocks (368 tokens) against 6 conversations whose system prompts alone take 30 blocks:
# each turn evicts the last one's prefixes, which only the host tier keeps.
SMALL = ("cache.num_blocks=24",)
TIER = ("cache.host_prefix_cache_gib=0.01",)


def multi_turn(engine, seed: int = 0, turns: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(75)] for _ in range(6)]
    outputs = []
    for _ in range(turns):
        prompts = [system + [rng.randrange(256) for _ in range(5)] for system in systems]
        outputs += [c.token_ids for c in generate_first_completions(engine, prompts, GREEDY)]
    return outputs


@pytest.fixture(scope="module")
def engines():
    return {"off": make_engine(*SMALL), "on": make_engine(*SMALL, *TIER),
            "on_sync": make_engine(*SMALL, *TIER, "engine.async_scheduling=false")}


def assert_nothing_held(engine) -> None:
    kv = engine.scheduler.kv
    assert not engine.has_unfinished_requests()
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks - 1
    if kv.host_cache is not None:
        kv.host_cache.check_invariants()
        assert kv.host_cache.num_held == 0 and not kv.restore and not kv.offload
        assert engine.runner.host_tier._pending == []


def test_the_host_tier_raises_prefix_hits_with_the_same_greedy_outputs_and_never_blocks(engines):
    off = multi_turn(engines["off"])
    off_hits = engines["off"].step_with_stats()[1].prefix_cache_hits
    for name in ("on", "on_sync"):
        engine = engines[name]
        before = engine.step_with_stats()[1]
        assert multi_turn(engine) == off, name
        stats = engine.step_with_stats()[1]
        assert stats.host_prefix_cache_hits - before.host_prefix_cache_hits >= 6 * 2 * 64  # turns 2, 3: 4 blocks each
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        assert hits >= stats.host_prefix_cache_hits - before.host_prefix_cache_hits and hits >= 3 * off_hits
        assert stats.host_tier_bytes_to_host > 0 and stats.host_tier_bytes_to_device > 0
        assert engine.runner.host_tier.num_blocking_lands == 0  # no device-to-host copy made the engine wait
        assert engine.num_recompiles == 0
        assert_nothing_held(engine)


def test_a_block_comes_back_from_the_host_bit_exact(engines):
    engine = engines["on"]
    runner, kv = engine.runner, engine.scheduler.kv
    prompt = list(range(40, 80))
    generate_first_completions(engine, [prompt], GREEDY)
    registered = {b: engine.block_pool.cached_block(b) for b in range(1, engine.block_pool.num_blocks)
                  if engine.block_pool.cached_block(b) is not None
                  and engine.block_pool.cached_block(b).token_ids == tuple(prompt[:16])}
    [(block, cached)] = registered.items()
    k, v = np.asarray(runner.kv_cache.k[:, :, block]), np.asarray(runner.kv_cache.v[:, :, block])
    multi_turn(engine, seed=5, turns=1)  # evicts it
    assert engine.block_pool.cached_block(block) is None or engine.block_pool.cached_block(block).token_ids != cached.token_ids
    restored_before = kv.num_restored_blocks
    generate_first_completions(engine, [prompt], GREEDY)
    assert kv.num_restored_blocks > restored_before
    [back] = [b for b in range(1, engine.block_pool.num_blocks) if engine.block_pool.cached_block(b) is not None
              and engine.block_pool.cached_block(b).block_hash == cached.block_hash]
    np.testing.assert_array_equal(np.asarray(runner.kv_cache.k[:, :, back]), k)
    np.testing.assert_array_equal(np.asarray(runner.kv_cache.v[:, :, back]), v)
    assert_nothing_held(engine)


def test_random_aborts_leak_nothing_in_either_pool(engines):
    engine = engines["on"]
    rng = random.Random(3)
    systems = [[rng.randrange(256) for _ in range(70)] for _ in range(6)]
    for round_ in range(3):
        ids = [engine.add_request(system + [rng.randrange(256) for _ in range(4)],
                                  SamplingParams(temperature=0, max_tokens=20)) for system in systems]
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 2 + round_:
                for rid in rng.sample(ids, 3):
                    engine.abort(rid)
    assert_nothing_held(engine)


@pytest.mark.parametrize("transfer", ["copy_to_host", "pinned_host"])
def test_host_blocks_restore_what_was_offloaded_whether_or_not_it_has_landed(transfer):
    """Both ways to host memory: copy_to_host_async (the CPU's default) and pinned host buffers (an
    accelerator's, which JAX's CPU client has too)."""
    import jax
    import jax.numpy as jnp

    from jaxcb.kernels.attention.cache import KVCache
    from jaxcb.kv_cache import HostBlocks, default_host_transfer

    assert default_host_transfer() == "copy_to_host"  # on the CPU
    shape = (2, 2, 40, 4, 8)  # layers, KV heads, blocks, block size, head dim
    values = jax.random.normal(jax.random.key(0), shape)
    cache = KVCache(k=values + 0, v=-values)  # a copy: the writes donate the cache
    host = HostBlocks(cache, 30, transfer=transfer)
    first = host.offload(cache, [(b, b) for b in range(1, 21)])  # two chunks
    if transfer == "pinned_host":
        assert {c.host_k.sharding.memory_kind for c in first} == {"pinned_host"}
    cache = host.restore(cache, [(3, 30), (19, 31)])  # before anything landed: read from the gathered arrays

    def finish(copies):  # their transfers done first: on a loaded machine one may still be on its way
        for copy in copies:
            jax.block_until_ready(copy.landing())

    finish(first)
    host.land(first)
    # Host block 5 is offloaded again from another device block: the later copy is what it holds.
    host.offload(cache, [(7, 5)])
    cache = host.restore(cache, [(5, 32), (12, 33)])
    finish(host._pending)
    host.land()
    cache = host.restore(cache, [(5, 34)])
    k = np.asarray(cache.k)
    for block, source in ((30, 3), (31, 19), (32, 7), (33, 12), (34, 7)):
        np.testing.assert_array_equal(k[:, :, block], np.asarray(values[:, :, source]), err_msg=str(block))
    np.testing.assert_array_equal(np.asarray(cache.v[:, :, 30]), -np.asarray(values[:, :, 3]))
    assert host.num_blocking_lands == 0 and host._pending == []


def test_copies_land_once_finished_oldest_first_and_the_engine_never_waits_for_one(monkeypatch):
    import jax

    from jaxcb.kernels.attention.cache import KVCache
    from jaxcb.kv_cache import HostBlocks, PendingCopy

    values = jax.random.normal(jax.random.key(1), (2, 2, 8, 4, 8))
    cache = KVCache(k=values + 0, v=-values)
    host = HostBlocks(cache, 10)
    first = host.offload(cache, [(1, 5)])
    second = host.offload(cache, [(2, 5)])  # the same host block again: the later copy's bytes must win
    ready = {id(first[0]): False, id(second[0]): True}
    monkeypatch.setattr(PendingCopy, "is_ready", lambda self: ready[id(self)])
    host.land_finished()
    assert host._pending == first + second  # the finished copy waits behind the unfinished earlier one
    ready[id(first[0])] = True
    host.land_finished()
    assert host._pending == [] and host.num_blocking_lands == 0
    np.testing.assert_array_equal(host.k[:, :, 5], np.asarray(values[:, :, 2]))


def test_a_restore_reads_the_newest_copy_of_a_host_block_while_an_older_one_is_on_its_way(monkeypatch):
    import jax

    from jaxcb.kernels.attention.cache import KVCache
    from jaxcb.kv_cache import HostBlocks, PendingCopy

    values = jax.random.normal(jax.random.key(2), (2, 2, 8, 4, 8))
    cache = KVCache(k=values + 0, v=-values)
    host = HostBlocks(cache, 10)
    older = host.offload(cache, [(1, 5)])
    newer = host.offload(cache, [(2, 5)])
    monkeypatch.setattr(PendingCopy, "is_ready", lambda self: self is newer[0])
    cache = host.restore(cache, [(5, 7)])  # the newer copy has finished, the older has not
    np.testing.assert_array_equal(np.asarray(cache.k[:, :, 7]), np.asarray(values[:, :, 2]))
    assert host._pending == older + newer  # neither landed ahead of the other
