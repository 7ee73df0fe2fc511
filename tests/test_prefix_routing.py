"""server.routing without Ray: the prefix index, the choice between prefix and load, the config checks."""

import asyncio
import random
import re
from types import SimpleNamespace

import pytest

from jaxcb.config import ConfigError, compose_config
from jaxcb.core.block_hash import block_hashes, model_root
from jaxcb.distributed.ray_server import RoutedReplica
from jaxcb.distributed.replica_metrics import RouterMetrics
from jaxcb.distributed.routing import (
    ROUTING_MODES, BlockHashSpec, PrefixIndex, ReplicaChooser, RouteReason, make_chooser, pick_least_loaded,
)

BLOCK = 4
ROOT = model_root({"model": "test", "block_size": BLOCK})


def chooser(mode="prefix_aware", num_replicas=2, index_blocks=1000, max_imbalance=2.0, slack=8) -> ReplicaChooser:
    c = ReplicaChooser(mode, num_replicas, index_blocks=index_blocks, max_imbalance=max_imbalance,
                       imbalance_slack_tokens=slack)
    for i in range(num_replicas):
        c.set_hash_spec(i, BlockHashSpec(BLOCK, ROOT))
    return c


def replicas(*loads: int) -> list[RoutedReplica]:
    return [RoutedReplica(i, None, waiting_tokens={f"r{i}": load} if load else {}) for i, load in enumerate(loads)]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def route(c: ReplicaChooser, live: list[RoutedReplica], prompt: list[int], in_flight: bool = False):
    """Choose, then do what the router does once the replica accepted: record (and count the load)."""
    choice = c.choose(live, prompt)
    c.record(choice)
    if in_flight:
        choice.replica.waiting_tokens[f"req{len(choice.replica.waiting_tokens)}-{id(prompt)}"] = len(prompt)
    return choice


def test_the_index_matches_the_leading_blocks_only():
    index = PrefixIndex(max_blocks=100)
    hashes = block_hashes(tokens(0, 20), BLOCK, ROOT)  # 5 blocks
    index.record(hashes[:3])
    assert index.num_matched_blocks(hashes) == 3
    # A block's hash covers every token before it: the same tokens from the second block on match nothing.
    assert index.num_matched_blocks(block_hashes(tokens(0, 20)[BLOCK:], BLOCK, ROOT)) == 0
    other = block_hashes(tokens(0, 8) + tokens(1, 12), BLOCK, ROOT)
    assert index.num_matched_blocks(other) == 2


def test_the_index_drops_the_least_recently_used_tails_first():
    index = PrefixIndex(max_blocks=6)
    old, new = block_hashes(tokens(0, 16), BLOCK, ROOT), block_hashes(tokens(1, 16), BLOCK, ROOT)
    index.record(old)
    index.record(new)  # 8 blocks recorded, 6 kept: the old chain's last two go
    assert len(index) == 6
    assert index.num_matched_blocks(old) == 2 and index.num_matched_blocks(new) == 4
    index.record(old[:1])  # a prompt of just the old head: it is now the most recent
    index.record(block_hashes(tokens(2, 4), BLOCK, ROOT))  # one more block: the least recent (old's 2nd) goes
    assert index.num_matched_blocks(old) == 1 and index.num_matched_blocks(new) == 4
    index.record(block_hashes(tokens(3, 4), BLOCK, ROOT))  # and then new's tail, never its head
    assert index.num_matched_blocks(old) == 1 and index.num_matched_blocks(new) == 3


def test_the_longest_tracked_prefix_wins():
    c = chooser(num_replicas=3)
    live = replicas(0, 0, 0)
    doc = tokens(0, 64)
    c.indexes[0].record(block_hashes(doc[:16], BLOCK, ROOT))
    c.indexes[1].record(block_hashes(doc[:48], BLOCK, ROOT))
    c.indexes[2].record(block_hashes(tokens(1, 64), BLOCK, ROOT))
    choice = c.choose(live, doc + tokens(2, 10))
    assert (choice.replica.index, choice.reason, choice.matched_tokens) == (1, RouteReason.PREFIX, 48)
    assert choice.block_hashes == block_hashes(doc + tokens(2, 10), BLOCK, ROOT)


def test_a_replica_past_the_imbalance_gives_way_to_the_least_loaded():
    c = chooser(max_imbalance=2.0, slack=8)
    prompt = tokens(0, 32)
    c.indexes[0].record(block_hashes(prompt, BLOCK, ROOT))
    # load(best) > 2 x load(least) + 8 tokens: too busy
    choice = c.choose(replicas(29, 10), prompt)
    assert (choice.replica.index, choice.reason, choice.matched_tokens) == (1, RouteReason.IMBALANCE, 0)
    choice = c.choose(replicas(28, 10), prompt)  # exactly at the bound: still allowed
    assert (choice.replica.index, choice.reason, choice.matched_tokens) == (0, RouteReason.PREFIX, 32)
    choice = c.choose(replicas(8, 0), prompt)  # an idle cluster follows prefixes within the slack
    assert (choice.replica.index, choice.reason) == (0, RouteReason.PREFIX)


def test_conversations_that_share_a_system_prompt_then_diverge_go_where_their_longest_prefix_is():
    c = chooser(slack=8)
    live = replicas(0, 0)
    system = tokens(0, 32)
    a1, b1 = system + tokens(1, 12), system + tokens(2, 12)
    first_a = route(c, live, a1, in_flight=True)
    assert first_a.reason == RouteReason.LOAD
    # b1 shares the system prompt with a1, but a1's replica is busy past the bound: b1 goes to the other one
    first_b = route(c, live, b1, in_flight=True)
    assert (first_b.reason, first_b.replica.index) == (RouteReason.IMBALANCE, 1 - first_a.replica.index)
    for r in live:
        r.waiting_tokens.clear()  # both first turns finished
    a2, b2 = a1 + tokens(3, 20), b1 + tokens(4, 20)
    for prompt, first in ((b2, first_b), (a2, first_a), (a2 + tokens(5, 9), first_a), (b2 + tokens(6, 9), first_b)):
        choice = route(c, live, prompt)
        assert (choice.replica.index, choice.reason, choice.matched_tokens) == (
            first.replica.index, RouteReason.PREFIX, 44 if prompt in (a2, b2) else 64)
    # a third conversation with the same system prompt matches both replicas equally: the least loaded takes it
    live[0].waiting_tokens["x"] = 5
    choice = route(c, live, system + tokens(7, 12))
    assert (choice.replica.index, choice.reason, choice.matched_tokens) == (1, RouteReason.PREFIX, 32)


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_all_distinct_prompts_are_spread_evenly(mode):
    c = chooser(mode)
    live = replicas(0, 0)
    rng = random.Random(0)
    counts = [0, 0]
    for i in range(200):
        for r in live:  # requests finish at random, so loads vary when the next one comes
            for rid in [rid for rid in r.waiting_tokens if rng.random() < 0.3]:
                del r.waiting_tokens[rid]
        choice = c.choose(live, tokens(1000 + i, rng.randrange(8, 200)))
        c.record(choice)
        choice.replica.waiting_tokens[f"q{i}"] = rng.randrange(8, 300)
        counts[choice.replica.index] += 1
        assert choice.reason == RouteReason.LOAD
    assert max(counts) <= 1.5 * min(counts), counts


def test_a_forgotten_replica_matches_nothing():
    c = chooser()
    prompt = tokens(0, 32)
    route(c, replicas(0, 0), prompt)
    [holder] = [i for i in (0, 1) if len(c.indexes[i])]
    c.forget(holder)
    assert len(c.indexes[holder]) == 0 and c.indexes[holder].max_blocks == 1000
    assert c.choose(replicas(0, 0), prompt).reason == RouteReason.LOAD


def test_one_live_replica_and_least_loaded_routing_say_so():
    assert chooser().choose(replicas(0, 0)[:1], tokens(0, 8)).reason == RouteReason.ONLY_REPLICA
    assert chooser().choose([], tokens(0, 8)) is None
    least = chooser("least_loaded")
    least.indexes[0].record(block_hashes(tokens(0, 32), BLOCK, ROOT))  # never consulted
    choice = least.choose(replicas(20, 10), tokens(0, 32))
    assert (choice.replica.index, choice.reason, choice.block_hashes) == (1, RouteReason.LOAD, [])


def test_least_loaded_picks_the_fewest_waiting_tokens_and_ties_take_turns():
    busy = RoutedReplica(0, None, waiting_tokens={"a": 50})
    idle = RoutedReplica(1, None, waiting_tokens={"b": 10, "c": 10})
    assert pick_least_loaded([busy, idle], turn=0, num_replicas=2) is idle
    even = [RoutedReplica(0, None), RoutedReplica(1, None)]
    assert [pick_least_loaded(even, turn, 2).index for turn in range(4)] == [0, 1, 0, 1]
    assert pick_least_loaded([], turn=0, num_replicas=2) is None


def test_a_salted_request_hashes_apart_and_replicas_without_stable_roots_get_one():
    srv = compose_config(("server.backend=ray", "server.num_replicas=2", "server.routing=prefix_aware")).server
    info = {"prefix_cache_root": None, "block_size": BLOCK, "num_blocks": 64}
    c = make_chooser(srv, "tiny", [info, {**info, "prefix_cache_root": ROOT}])
    assert c.hash_specs[0].root == model_root({"model": "tiny", "block_size": BLOCK}) and c.hash_specs[1].root == ROOT
    assert c.indexes[0].max_blocks == 64  # routing_index_blocks=null: the replica's KV-cache blocks
    prompt = tokens(0, 16)
    c.indexes[1].record(block_hashes(prompt, BLOCK, ROOT))
    live = replicas(0, 0)
    assert c.choose(live, prompt).replica.index == 1
    assert c.choose(live, prompt, cache_salt="tenant-b").reason == RouteReason.LOAD


@pytest.mark.parametrize("metrics_prefix", ["jaxcb", "vllm"])
def test_each_routing_decision_is_counted_by_reason_with_its_matched_prefix(metrics_prefix):
    c = chooser()
    router = SimpleNamespace(cfg=compose_config((f"server.metrics_prefix={metrics_prefix}",)), replicas=[], chooser=c)
    metrics = RouterMetrics(router, "tiny")
    live = replicas(0, 0)
    prompt = tokens(0, 40)
    for p in (prompt, prompt + tokens(1, 30), tokens(2, 9)):  # load, prefix (40 tokens matched), load
        metrics.request_routed(route(c, live, p))
    text = asyncio.run(metrics.render()).decode()
    p = metrics_prefix
    decisions = [line for line in text.splitlines() if line.startswith(f"{p}:router_route_decisions_total{{")]
    assert sorted((re.search(r'reason="(\w+)"', line).group(1), line.split()[-1]) for line in decisions) == [
        ("load", "1.0"), ("load", "1.0"), ("prefix", "1.0")]  # one line per (replica, reason)
    assert f'{p}:router_matched_prefix_tokens_count{{model_name="tiny"}} 3.0' in text
    assert f'{p}:router_matched_prefix_tokens_sum{{model_name="tiny"}} 40.0' in text
    assert f'{p}:router_matched_prefix_tokens_bucket{{le="0.0",model_name="tiny"}} 2.0' in text


@pytest.mark.parametrize("overrides, message", [
    (("server.routing=nearest",), "server.routing='nearest' must be one of least_loaded, prefix_aware"),
    (("server.routing=prefix_aware",), "needs server.backend=ray"),
    (("server.backend=ray", "server.routing=prefix_aware", "cache.enable_prefix_caching=false"),
     "needs cache.enable_prefix_caching=true"),
    (("server.routing_max_imbalance=0.5",), "server.routing_max_imbalance=0.5 must be >= 1"),
    (("server.routing_index_blocks=0",), "server.routing_index_blocks=0 must be >= 1"),
    (("server.routing_imbalance_slack_tokens=-1",), "server.routing_imbalance_slack_tokens=-1 must be >= 0"),
    (("server.backend=ray", "server.routing_max_imbalance=3"),
     "server.routing_max_imbalance=3.0 is used only by server.routing=prefix_aware (server.routing=least_loaded)"),
])
def test_routing_config_mistakes_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config(overrides)


def test_the_validated_routing_modes_are_the_routers():
    for mode in ROUTING_MODES:
        assert compose_config((f"server.routing={mode}", "server.backend=ray")).server.routing == mode
    knobs = ("server.routing_index_blocks=4096", "server.routing_max_imbalance=1.5",
             "server.routing_imbalance_slack_tokens=0")
    srv = compose_config(("server.backend=ray", "server.routing=prefix_aware") + knobs).server
    assert (srv.routing_index_blocks, srv.routing_max_imbalance, srv.routing_imbalance_slack_tokens) == (4096, 1.5, 0)
