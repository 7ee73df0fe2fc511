"""Prefix hits within a step, checked by a fake device that sees every read of the cache (no model).

A block becomes findable in the prefix cache from the step that fills it (`Scheduler.schedule`
registers it when the step is built), so a sequence may attend to blocks another one fills in
the same step. The fake device runs each dispatched step as every attention form must: swap
copies, then all of the step's K/V writes, then every row reads its whole context. A slot holds
what its K/V depends on -- the sequence's tokens up to its position -- so a row that reads a
block nobody filled, or filled with other tokens, fails at the read, whatever the path that
led there: a hit in the same step or a later one, preemption (recompute, swap, for priority),
abort, the async overlap. Tokens are "sampled" as a function of the prompt and the position,
so sequences with the same prompt generate the same tokens, as greedy decoding does.
"""

from __future__ import annotations

import itertools
import random

import pytest

from jaxcb.config import SchedulerConfig
from jaxcb.core import kv_cache_manager
from jaxcb.core.block_hash import block_hashes
from jaxcb.core.block_pool import BlockPool
from jaxcb.core.scheduler import Scheduler
from jaxcb.core.sequence import RequestStatus, Sequence
from jaxcb.core.step import RunnerOutput, SampledToken, SchedulerOutput
from jaxcb.sampling_params import SamplingParams

BLOCK = 4


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def token_at(prompt: list[int], index: int) -> int:
    """The index-th output token of any sequence with this prompt (a "greedy" model)."""
    return 1000 + (sum(prompt) * 7 + index * 13) % 97


def true_tokens(seq: Sequence) -> list[int]:
    """Its tokens with the ones in flight as the device has them."""
    return seq.prompt_token_ids + [token_at(seq.prompt_token_ids, i) for i in range(seq.num_output_tokens)]


class FakeDevice:
    """The cache as a step sees it: each slot holds the tokens its K/V were computed from."""

    def __init__(self):
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (device block, offset) -> tokens up to it
        self.host: dict[tuple[int, int], tuple[int, ...]] = {}  # (host block, offset) -> the same

    def run(self, out: SchedulerOutput, sequences: dict, pool: BlockPool, root: bytes | None) -> None:
        """root: the prefix cache's, to check every registered block's contents (None: not checked)."""
        for host, dev in out.swap_in:  # swap-in first, then swap-out, then the step (ModelRunner.dispatch)
            for o in range(BLOCK):
                self._copy(self.host, (host, o), self.slots, (dev, o))
        for dev, host in out.swap_out:
            for o in range(BLOCK):
                self._copy(self.slots, (dev, o), self.host, (host, o))
        rows = [(s, true_tokens(sequences[s.seq_id])) for s in out.scheduled]
        for s, tokens in rows:  # every row's K/V write lands before any row reads (the attention invariant)
            for pos in range(s.start_position, s.start_position + len(s.token_ids)):
                self.slots[(s.block_ids[pos // BLOCK], pos % BLOCK)] = tuple(tokens[: pos + 1])
        self.check_registered_blocks(pool, root)
        for s, tokens in rows:
            for pos in range(s.start_position + len(s.token_ids)):
                got = self.slots.get((s.block_ids[pos // BLOCK], pos % BLOCK))
                assert got == tuple(tokens[: pos + 1]), (
                    f"{s.seq_id} reads position {pos} from block {s.block_ids[pos // BLOCK]}, which holds "
                    f"{'nothing' if got is None else 'the K/V of other tokens'}"
                )

    def check_registered_blocks(self, pool: BlockPool, root: bytes | None) -> None:
        """Every block findable in the prefix cache holds (once this step's writes land) the tokens
        its entry says, after the contents its parent names, and (root given) its hash stands for them."""
        entries = {e.content_id: e for e in map(pool.cached_block, range(1, pool.num_blocks)) if e is not None}
        for entry in entries.values():
            last = self.slots.get((entry.block, BLOCK - 1))
            filled = last is not None and all(
                self.slots.get((entry.block, o)) == last[: len(last) - BLOCK + 1 + o] for o in range(BLOCK))
            assert filled, f"block {entry.block} is registered but this step does not fill it"
            assert entry.token_ids == last[-BLOCK:], f"block {entry.block}: other tokens"
            prefix, parent = last[:-BLOCK], entry.parent
            while parent in entries:  # up the chain, as far as its blocks are still cached
                assert entries[parent].token_ids == prefix[-BLOCK:], f"block {entry.block}: another parent"
                prefix, parent = prefix[:-BLOCK], entries[parent].parent
            assert isinstance(parent, int) or prefix == (), f"block {entry.block}: its chain's root is not at 0"
            if root is not None:
                assert block_hashes(last, BLOCK, root)[-1] == entry.block_hash, f"block {entry.block}: another hash"

    @staticmethod
    def _copy(src, src_key, dst, dst_key):
        if src_key in src:
            dst[dst_key] = src[src_key]
        else:
            dst.pop(dst_key, None)


class Driver:
    """The engine's loop around a scheduler: schedule, dispatch (the fake device runs it), commit;
    under async scheduling a step's tokens are applied after the next one is dispatched."""

    def __init__(self, sched: Scheduler, async_scheduling: bool, check_hashes: bool = True):
        self.sched, self.async_scheduling = sched, async_scheduling
        self.check_hashes = check_hashes  # False: the test replaced the hash function
        self.device = FakeDevice()
        self.sequences: dict = {}  # every sequence ever added, by id (the scheduler forgets finished ones)
        self.pending: SchedulerOutput | None = None
        self.num_steps = 0

    def add(self, seq: Sequence) -> Sequence:
        self.sequences[seq.seq_id] = seq
        self.sched.add_request(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        if not out.is_empty:
            kv = self.sched.kv
            root = kv.root if kv.enable_prefix_caching and self.check_hashes else None
            self.device.run(out, self.sched.sequences, self.sched.pool, root)
            self.sched.commit(out)
        self.num_steps += 1
        if self.async_scheduling:
            previous, self.pending = self.pending, (out if not out.is_empty else None)
        else:
            previous = out
        if previous is not None:
            self._apply(previous)
        return out

    def _apply(self, out: SchedulerOutput) -> None:
        sampled = {}
        for s in out.scheduled:
            seq = self.sched.sequences.get(s.seq_id)
            if s.samples and seq is not None:
                sampled[s.seq_id] = SampledToken(token_at(seq.prompt_token_ids, s.num_output_tokens))
        self.sched.update(out, RunnerOutput(sampled))
        for s in out.scheduled:  # the output processor's length stop: this step drew token num_output_tokens
            if s.seq_id in sampled and s.num_output_tokens + 1 >= s.sampling_params.max_tokens:
                self.sched.finish(s.seq_id, RequestStatus.FINISHED_LENGTH)

    def run_until_done(self, max_steps: int = 3000) -> None:
        while self.sched.num_unfinished or self.pending is not None:
            self.step()
            assert self.num_steps < max_steps

    def check_done(self) -> None:
        """Every sequence that was not aborted generated its tokens, and nothing is leaked."""
        for seq in self.sequences.values():
            if seq.status is not RequestStatus.FINISHED_ABORTED:
                expected = [token_at(seq.prompt_token_ids, i) for i in range(seq.sampling_params.max_tokens)]
                assert seq.output_token_ids == expected, seq.seq_id
        for pool in (self.sched.pool, self.sched.kv.host_pool):
            if pool is not None:
                assert pool.num_free_blocks == pool.num_blocks - 1
                pool.check_invariants()


def make_scheduler(num_blocks=64, host_blocks=0, clock=None, **cfg) -> Scheduler:
    cfg = dict(dict(max_num_seqs=8, max_num_batched_tokens=32), **cfg)
    return Scheduler(
        SchedulerConfig(**cfg), BlockPool(num_blocks), BLOCK, 512, enable_prefix_caching=True,
        host_pool=BlockPool(host_blocks) if host_blocks else None, **({"clock": clock} if clock else {}),
    )


def seq(rid, prompt, max_tokens=3, **kw) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), **kw)


SYSTEM = list(range(100, 113))  # 13 tokens: 3 full blocks of 4


# --- hits within a step -------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_admitted_in_one_step_share_the_prefix_the_first_one_fills(async_scheduling):
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling)
    a, b, c = (driver.add(seq(f"r{i}", SYSTEM + [50 + i, 60 + i])) for i in range(3))
    out = driver.step()
    assert [(s.seq_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [
        ("r0", 0, 15), ("r1", 12, 3), ("r2", 12, 3)]  # the followers compute only their own tokens
    assert b.block_ids[:3] == a.block_ids[:3] == c.block_ids[:3]
    assert sched.prefix_cache_hits == 2 * 12
    driver.run_until_done()
    driver.check_done()


def test_a_request_arriving_during_a_chunked_prefill_finds_the_chunks_already_scheduled():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_partial_prefills=2)
    driver = Driver(sched, async_scheduling=True)
    long_prompt = list(range(200, 230))  # 30 tokens: chunks of 8
    first = driver.add(seq("first", long_prompt))
    driver.step()  # [0, 8): 2 blocks, registered as the step is built
    second = driver.add(seq("second", long_prompt[:20] + [7, 7, 7]))
    out = driver.step()  # first computes [8, 16); second finds all four of its blocks it shares
    chunks = {s.seq_id: (s.start_position, len(s.token_ids)) for s in out.scheduled}
    assert chunks == {"first": (8, 8), "second": (16, 7)}
    assert second.block_ids[:4] == first.block_ids[:4]
    driver.run_until_done()
    driver.check_done()


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_samples_share_the_prompt_from_the_step_that_fills_it(enable_prefix_caching):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockPool(64), BLOCK, 512,
                      enable_prefix_caching=enable_prefix_caching)
    driver = Driver(sched, async_scheduling=True)
    params = SamplingParams(n=3, max_tokens=4, temperature=0)
    for i in range(3):
        driver.add(Sequence(("r", i), SYSTEM + [9], params, parent_id=("r", 0) if i else None, sample_index=i))
    out = driver.step()
    assert [s.start_position for s in out.scheduled] == [0, 12, 12]
    driver.run_until_done()
    driver.check_done()


def test_a_block_whose_last_token_is_in_flight_is_registered_only_once_it_arrives():
    sched = make_scheduler()
    driver = Driver(sched, async_scheduling=True)
    a = driver.add(seq("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=6))  # the first output token ends block 1
    driver.step()  # prefill, samples o0 (in flight)
    driver.step()  # computes o0 (it completes block 1) while it is in flight; step 1's tokens arrive after
    assert a.num_registered_blocks == 2  # registered by update(), once o0 was known
    b = driver.add(seq("b", a.prompt_token_ids + [a.output_token_ids[0], 5]))
    out = driver.step()
    assert {s.seq_id: s.start_position for s in out.scheduled}["b"] == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    driver.run_until_done()
    driver.check_done()


# --- preemption and abort ----------------------------------------------------------------------


def test_a_request_preempted_for_priority_leaves_no_block_the_step_does_not_fill():
    """x (low priority) prefills in chunks; z (urgent, the same prompt) finds x's chunk of this
    step; h (less urgent than z, more than x) cannot start (max_num_seqs), so x must yield -- but
    not in the step whose blocks z took: priority preemption is decided before any of the step's
    blocks are registered, and a step that preempts admits nobody."""
    clock = FakeClock()
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=2, max_num_batched_tokens=64,
                           long_prefill_token_threshold=8, max_num_partial_prefills=2)
    driver = Driver(sched, async_scheduling=False)
    prompt = list(range(300, 324))  # 6 blocks
    x = driver.add(seq("x", prompt, priority=5, arrival_time=0.0))
    driver.step()  # x: [0, 8)
    clock.now = 1.0
    z = driver.add(seq("z", prompt[:16] + [1, 2], priority=0, arrival_time=1.0))
    driver.add(seq("h", [7, 8, 9], priority=1, arrival_time=1.0))
    out = driver.step()  # x: [8, 16) and z, which finds x's four blocks; h waits for a place
    assert {s.seq_id: s.start_position for s in out.scheduled} == {"x": 8, "z": 16}
    assert z.block_ids[:4] == x.block_ids[:4] and not out.preempted_ids
    out = driver.step()
    assert out.preempted_ids == ["x"]  # now that x's blocks are filled
    driver.run_until_done()
    driver.check_done()


def test_a_request_preempted_after_its_chunk_was_scheduled_in_the_same_step_registers_none_of_it():
    """a runs first but has computed least: its chunk is scheduled, then b finds no free block and
    a is the victim. The running sequences' blocks are registered only once no one can be
    preempted any more, so the blocks of a's withdrawn chunk are never findable."""
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    driver = Driver(sched, async_scheduling=False)
    cached = list(range(700, 716))  # 4 blocks, in the cache once p is done
    driver.add(seq("p", cached, max_tokens=1))
    driver.run_until_done()
    driver.add(seq("a", list(range(800, 830)), max_tokens=2))
    driver.add(seq("b", cached + [1, 2, 3, 4], max_tokens=4))
    out = driver.step()  # a: [0, 8); b finds the 4 cached blocks and computes [16, 20)
    assert {s.seq_id: s.start_position for s in out.scheduled} == {"a": 0, "b": 16}
    out = driver.step()  # a: [8, 16) takes the last two free blocks; b's decode needs one more
    assert out.preempted_ids == ["a"] and [s.seq_id for s in out.scheduled] == ["b"]
    assert sched.pool.num_cached_blocks == 4 + 1 + 2  # p's, b's [16, 20), a's [0, 8): not a's withdrawn chunk
    driver.run_until_done()
    driver.check_done()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_of_a_request_preempted_before_its_step_ran_are_still_filled_by_that_step(async_scheduling):
    """x's first chunk is registered as its step is built; the next schedule() preempts x
    (recompute) -- under async scheduling before that step's tokens are back. The step was
    dispatched, so the blocks are filled: x, re-admitted, finds its own first chunk."""
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    driver = Driver(sched, async_scheduling)
    driver.add(seq("old", list(range(500, 508)), max_tokens=3))
    driver.step()
    x = driver.add(seq("x", list(range(600, 616)), max_tokens=2))
    out = driver.step()
    assert [(s.seq_id, s.start_position) for s in out.scheduled] == [("old", 8), ("x", 0)]
    out = driver.step()  # x's next chunk does not fit, and x has computed least
    assert out.preempted_ids == ["x"] and x.num_computed_tokens == 0
    starts = []
    while sched.num_unfinished or driver.pending is not None:
        starts += [s.start_position for s in driver.step().scheduled if s.seq_id == "x"]
    assert starts[0] == 8  # its first chunk came from the cache
    driver.check_done()


def test_aborting_the_owner_keeps_the_blocks_another_request_shares():
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling=True)
    a = driver.add(seq("a", SYSTEM + [1, 2], max_tokens=8))
    b = driver.add(seq("b", SYSTEM + [3, 4], max_tokens=8))
    driver.step()
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared
    assert sched.abort("a")
    assert [sched.pool.ref_count(blk) for blk in shared] == [1, 1, 1]
    assert all(sched.pool.is_registered(blk) for blk in shared)
    c = driver.add(seq("c", SYSTEM + [5]))
    out = driver.step()
    assert {s.seq_id: s.start_position for s in out.scheduled}["c"] == 12
    assert c.block_ids[:3] == shared
    driver.run_until_done()
    driver.check_done()


def test_a_swapped_out_request_comes_back_with_its_blocks_findable_again():
    sched = make_scheduler(num_blocks=9, host_blocks=16, preemption_mode="swap", max_num_batched_tokens=16)
    driver = Driver(sched, async_scheduling=True)
    driver.add(seq("old", list(range(500, 508)), max_tokens=14))
    driver.step()
    driver.add(seq("x", list(range(600, 616)), max_tokens=6))
    driver.run_until_done()
    assert sched.num_swap_outs >= 1 and sched.num_swap_ins == sched.num_swap_outs
    driver.check_done()


# --- hashes that collide ------------------------------------------------------------------------


@pytest.fixture
def colliding_hashes(monkeypatch):
    """Every full block at the same depth of a chain gets the same hash whatever its tokens, and
    every salt (or n > 1 group) the same root: each lookup finds another chain's block, as tokens
    crafted against XXH3 could make it, and a hit must still be refused."""
    chain_hash = kv_cache_manager.chain_hash
    monkeypatch.setattr(kv_cache_manager, "chain_hash", lambda parent, token_ids: chain_hash(parent, []))
    monkeypatch.setattr(kv_cache_manager, "salted_root", lambda root, salt: root)


OTHER = list(range(150, 163))  # 13 tokens, none of SYSTEM's: under colliding_hashes, the same 3 hashes


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_block_whose_hash_collides_within_the_step_is_not_a_hit(colliding_hashes, async_scheduling):
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling, check_hashes=False)
    a, b = driver.add(seq("a", SYSTEM + [1, 2])), driver.add(seq("b", OTHER + [1, 2]))
    c = driver.add(seq("c", SYSTEM + [3]))  # a's tokens: a hit, through the chain a registered
    out = driver.step()
    assert [(s.seq_id, s.start_position) for s in out.scheduled] == [("a", 0), ("b", 0), ("c", 12)]
    assert set(a.block_ids).isdisjoint(b.block_ids) and c.block_ids[:3] == a.block_ids[:3]
    assert sched.prefix_cache_hits == 12 and sched.pool.num_cached_blocks == 3  # b's blocks: not cacheable
    driver.run_until_done()  # the fake device checks that b read its own K/V
    driver.check_done()


def test_a_cached_block_whose_hash_collides_is_not_a_hit(colliding_hashes):
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling=True, check_hashes=False)
    driver.add(seq("a", SYSTEM + [1, 2]))
    driver.run_until_done()  # a's blocks wait in the free queue, findable under the colliding hashes
    assert sched.pool.num_cached_blocks == 4  # its prompt's 3, and the 4th its first two outputs fill
    b = driver.add(seq("b", OTHER + [1, 2]))
    out = driver.step()
    assert [(s.seq_id, s.start_position) for s in out.scheduled] == [("b", 0)] and sched.prefix_cache_hits == 0
    c = driver.add(seq("c", OTHER[:8] + SYSTEM[8:12] + [5]))  # b's first 2 blocks, then a's third block's tokens
    out = driver.step()
    assert {s.seq_id: s.start_position for s in out.scheduled}["c"] == 0  # b's blocks collided: not cached
    driver.run_until_done()
    assert c.num_output_tokens == 3
    driver.check_done()


def test_a_block_after_another_parent_is_not_a_hit_even_with_its_tokens(colliding_hashes):
    """The chain is compared link by link: c's third block has the tokens of a's third block, but
    follows other blocks, so a's K/V for it are not c's."""
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling=False, check_hashes=False)
    a = driver.add(seq("a", SYSTEM + [1, 2]))
    driver.step()
    d = driver.add(seq("d", SYSTEM[:4] + OTHER[4:8] + SYSTEM[8:12] + [9]))  # a's first block only
    out = driver.step()
    assert {s.seq_id: s.start_position for s in out.scheduled}["d"] == 4
    assert d.block_ids[0] == a.block_ids[0] and d.block_ids[2] != a.block_ids[2]
    driver.run_until_done()
    driver.check_done()


@pytest.mark.parametrize("together", [True, False], ids=["same-step", "later-step"])
def test_the_same_tokens_under_another_salt_are_not_a_hit_when_the_roots_collide(colliding_hashes, together):
    sched = make_scheduler(max_num_batched_tokens=64)
    driver = Driver(sched, async_scheduling=True, check_hashes=False)
    a = driver.add(seq("a", SYSTEM + [1], cache_salt="tenant-a"))
    if not together:
        driver.step()
        a_blocks = a.block_ids[:3]
        driver.run_until_done()  # a's blocks wait in the free queue
    b = driver.add(seq("b", SYSTEM + [1], cache_salt="tenant-b"))
    u = driver.add(seq("u", SYSTEM + [1]))  # no salt
    a2 = driver.add(seq("a2", SYSTEM + [2], cache_salt="tenant-a"))
    out = driver.step()
    if together:
        a_blocks = a.block_ids[:3]
    starts = {s.seq_id: s.start_position for s in out.scheduled}
    assert (starts["b"], starts["u"], starts["a2"]) == (0, 0, 12)  # only a's own tenant finds its blocks
    assert set(b.block_ids).isdisjoint(a_blocks) and set(u.block_ids).isdisjoint(a_blocks)
    assert a2.block_ids[:3] == a_blocks and sched.prefix_cache_hits == 12
    driver.run_until_done()
    driver.check_done()


def test_n_groups_with_caching_off_never_share_when_their_roots_collide(colliding_hashes):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockPool(64), BLOCK, 512)
    driver = Driver(sched, async_scheduling=True)
    params = SamplingParams(n=2, max_tokens=3, temperature=0)
    seqs = [driver.add(Sequence((r, i), SYSTEM + [1], params, parent_id=(r, 0) if i else None, sample_index=i))
            for r in ("p", "q") for i in range(2)]
    out = driver.step()
    # q's hashes are p's: q0's blocks cannot be cached, so q1 computes its prompt too -- a miss, never p's K/V.
    assert [s.start_position for s in out.scheduled] == [0, 12, 0, 0]
    p0, p1, q0, q1 = seqs
    assert p1.block_ids[:3] == p0.block_ids[:3]
    assert set(p0.block_ids).isdisjoint(q0.block_ids) and set(p0.block_ids).isdisjoint(q1.block_ids)
    driver.run_until_done()
    driver.check_done()


# --- everything at once -------------------------------------------------------------------------


CONFIGS = {
    "fcfs": dict(),
    "small-budget": dict(max_num_batched_tokens=8, max_num_partial_prefills=2),
    "threshold": dict(long_prefill_token_threshold=6, max_num_partial_prefills=3),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=40),
    "swap": dict(preemption_mode="swap", host_blocks=24),
    "priority": dict(policy="priority", priority_aging_s=5.0),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_shared_prefix_workloads_read_only_filled_blocks_and_leak_nothing(config, async_scheduling):
    for seed in range(20):
        rng = random.Random(seed)
        clock = FakeClock()
        sched = make_scheduler(num_blocks=rng.choice([14, 20, 40]), clock=clock, **CONFIGS[config])
        driver = Driver(sched, async_scheduling)
        prefixes = [[rng.randrange(1, 90) for _ in range(rng.randint(3, 14))] for _ in range(3)]
        ids = itertools.count()
        arrivals: dict[int, list[Sequence]] = {}
        for _ in range(14):
            prompt = rng.choice(prefixes) + [rng.randrange(1, 90) for _ in range(rng.randint(0, 6))]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(n=n, max_tokens=rng.randint(1, 8), temperature=0)
            rid, step = f"q{next(ids)}", rng.randint(0, 12)
            prio = rng.randint(0, 3)
            for i in range(n):
                arrivals.setdefault(step, []).append(Sequence(
                    (rid, i), list(prompt), params, priority=prio, arrival_time=step + 0.01 * i,
                    parent_id=(rid, 0) if i else None, sample_index=i,
                ))
        aborts = {rng.randint(0, 20): (f"q{rng.randrange(14)}", i) for i in range(3)}
        while arrivals or sched.num_unfinished or driver.pending is not None:
            clock.now = float(driver.num_steps)
            for s in arrivals.pop(driver.num_steps, []):
                driver.add(s)
            if driver.num_steps in aborts:
                sched.abort(aborts[driver.num_steps])
            driver.step()
            assert driver.num_steps < 3000
        assert sched.prefix_cache_hits > 0
        driver.check_done()
