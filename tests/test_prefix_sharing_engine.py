"""Prefix hits within a step on the tiny model: greedy outputs equal one-at-a-time greedy, nothing leaks.

The engines are test_engine.py's (same overrides, so one compile serves both files in a run).
"""

from __future__ import annotations

import random

import pytest

from engine_factory import shared_engine
from jaxcb.sampling_params import SamplingParams
from test_engine import SMALL_CACHE, SWAP, alone, assert_same_or_tied, run_with_arrivals

ENGINES = {
    "async": (SMALL_CACHE, "scheduler.policy=fcfs"),
    "sync": (SMALL_CACHE, "engine.async_scheduling=false"),
    "swap": (SMALL_CACHE, "scheduler.policy=fcfs", *SWAP),
    "priority": (SMALL_CACHE, "scheduler.policy=priority"),
}


def burst(seed: int, num_groups: int = 4, group_size: int = 4, prefix_len: int = 40) -> list[tuple]:
    """Groups of requests sharing a prefix (2 full blocks + 8 tokens), all arriving at step 0."""
    rng = random.Random(seed)
    work = []
    for g in range(num_groups):
        prefix = [rng.randrange(256) for _ in range(prefix_len)]
        for m in range(group_size):
            own = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            work.append((f"g{g}m{m}", prefix + own, rng.randint(1, 24), 0))
    return work


def assert_no_block_leaked(engine) -> None:
    assert not engine.has_unfinished_requests()
    for pool in (engine.block_pool, engine.scheduler.kv.host_pool):
        if pool is not None:
            assert pool.num_free_blocks == pool.num_blocks - 1
            pool.check_invariants()


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_burst_of_shared_prefix_requests_gives_greedy_outputs_and_leaks_nothing(name):
    engine = shared_engine(*ENGINES[name])
    work = burst(seed=len(name))
    rng = random.Random(7)
    priority = {rid: rng.randint(0, 2) for rid, *_ in work}
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    s = engine.scheduler
    preemptions0, swaps0, hits0 = s.num_preemptions, s.num_swap_outs, s.prefix_cache_hits
    if name == "priority":
        results = {}
        for rid, prompt, max_tokens, _ in work:
            engine.add_request(prompt, greedy(rid, max_tokens), request_id=rid, priority=priority[rid])
        while engine.has_unfinished_requests():
            results.update({o.request_id: o for o in engine.step() if o.finished})
    else:
        results = run_with_arrivals(engine, work, greedy)
    assert s.num_preemptions > preemptions0, "the cache should be small enough to preempt"
    assert s.num_swap_outs > swaps0 if name == "swap" else True
    assert s.prefix_cache_hits - hits0 >= 32 * 3 * 4  # most of each group's followers found the prefix
    for rid, prompt, max_tokens, _ in work:
        assert_same_or_tied(results[rid].outputs[0].token_ids, alone(engine, prompt, max_tokens))
    assert_no_block_leaked(engine)
    assert engine.num_recompiles == 0


def test_requests_admitted_in_one_step_compute_their_shared_prefix_once():
    engine = shared_engine(*ENGINES["async"])
    prefix = [random.Random(3).randrange(256) for _ in range(40)]
    prompts = [prefix + [1], prefix + [2, 3], prefix + [4]]
    hits0 = engine.scheduler.prefix_cache_hits
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=5)) for p in prompts]
    engine.step()  # one step admits all three: the second and third find the first one's two blocks
    assert engine.scheduler.prefix_cache_hits - hits0 == 2 * 32
    outputs, stats = engine.step_with_stats()  # async: the first step's outputs, and its figures
    assert stats.num_tokens == 41 + (42 - 32) + (41 - 32)
    outs = {o.request_id: o for o in outputs if o.finished}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt in zip(ids, prompts):
        assert outs[rid].num_cached_tokens == (0 if rid == ids[0] else 32)
        assert_same_or_tied(outs[rid].outputs[0].token_ids, alone(engine, prompt, 5))
    assert_no_block_leaked(engine)


def test_n_greedy_samples_share_the_prompt_with_prefix_caching_off():
    engine = shared_engine(SMALL_CACHE, "cache.enable_prefix_caching=false")
    prompt = [random.Random(4).randrange(256) for _ in range(50)]
    engine.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), request_id="n3")
    engine.step()
    leader, *followers = [s for s in engine.scheduler.running if s.group_id == "n3"]
    assert all(f.block_ids[:3] == leader.block_ids[:3] for f in followers)  # the 3 full prompt blocks
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    ref = alone(engine, prompt, 8)
    for c in out.outputs:
        assert_same_or_tied(c.token_ids, ref)
    assert engine.scheduler.prefix_cache_hits == 0
    assert_no_block_leaked(engine)


def test_aborting_the_request_that_fills_a_shared_prefix_leaves_the_others_correct():
    engine = shared_engine(*ENGINES["async"])
    work = burst(seed=21, num_groups=2, group_size=3)
    greedy = lambda rid, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    results = run_with_arrivals(engine, work, greedy, abort_at={"g0m0": 1, "g1m0": 2})
    for rid, prompt, max_tokens, _ in work:
        if results[rid] is not None:
            assert_same_or_tied(results[rid].outputs[0].token_ids, alone(engine, prompt, max_tokens))
    assert results["g0m0"] is None and results["g1m0"] is None
    assert_no_block_leaked(engine)


def forge_hashes(monkeypatch, blocks: dict[tuple, list[int]] | None = None, salts: dict | None = None) -> None:
    """Make the prefix cache's hash collide as crafted tokens could make XXH3 collide: a block of the
    tokens in `blocks` hashes as the block it maps to, a salt in `salts` as the salt it maps to."""
    from jaxcb.core import kv_cache_manager

    blocks, salts = blocks or {}, salts or {}
    chain_hash, salted_root = kv_cache_manager.chain_hash, kv_cache_manager.salted_root
    monkeypatch.setattr(kv_cache_manager, "chain_hash",
                        lambda parent, token_ids: chain_hash(parent, blocks.get(tuple(token_ids), token_ids)))
    monkeypatch.setattr(kv_cache_manager, "salted_root", lambda root, salt: salted_root(root, salts.get(salt, salt)))


def generate(engine, requests: list[tuple[list[int], str | None]], together: bool) -> list[list[int]]:
    """Each (prompt, cache_salt)'s greedy tokens: submitted at once (one step admits them all), or one by one."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batches = [requests] if together else [[r] for r in requests]
    tokens = []
    for batch in batches:
        ids = [engine.add_request(prompt, params, cache_salt=salt) for prompt, salt in batch]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens += [done[i] for i in ids]
    return tokens


@pytest.mark.parametrize("together", [True, False], ids=["same-step", "later-step"])
def test_prompts_whose_block_hashes_collide_never_share_kv(monkeypatch, together):
    """b's two full blocks hash as a's: b gets no hit on a's blocks, in the step that registers them
    or later, and its output is the one without prefix caching."""
    rng = random.Random(31 + together)
    a, b = ([rng.randrange(256) for _ in range(40)] for _ in range(2))  # 2 full blocks of 16, then 8 tokens
    forge_hashes(monkeypatch, blocks={tuple(b[i : i + 16]): a[i : i + 16] for i in (0, 16)})
    engine = shared_engine(*ENGINES["async"])
    hits0 = engine.scheduler.prefix_cache_hits
    got = generate(engine, [(a, None), (b, None)], together)
    assert engine.scheduler.prefix_cache_hits == hits0
    off = shared_engine(SMALL_CACHE, "cache.enable_prefix_caching=false")
    assert got == generate(off, [(a, None), (b, None)], together)
    assert_no_block_leaked(engine)


@pytest.mark.parametrize("together", [True, False], ids=["same-step", "later-step"])
def test_tenants_whose_salted_roots_collide_never_share_kv(monkeypatch, together):
    """Every salt's chain root collides with the unsalted one: the same prompt under three tenants
    gets no hit across them, only within its own, and outputs what it does without caching."""
    forge_hashes(monkeypatch, salts={"tenant-a": None, "tenant-b": None})
    prompt = [random.Random(33 + together).randrange(256) for _ in range(40)]
    tenants = [(prompt, "tenant-a"), (prompt, "tenant-b"), (prompt, None)]
    engine = shared_engine(*ENGINES["async"])
    hits0 = engine.scheduler.prefix_cache_hits
    got = generate(engine, tenants, together)
    assert engine.scheduler.prefix_cache_hits == hits0  # the same tokens, but never across tenants
    assert generate(engine, [(prompt, "tenant-a")], together) == got[:1]
    assert engine.scheduler.prefix_cache_hits == hits0 + 32  # its own tenant finds its 2 blocks
    off = shared_engine(SMALL_CACHE, "cache.enable_prefix_caching=false")
    assert got == generate(off, tenants, together)
    assert_no_block_leaked(engine)
