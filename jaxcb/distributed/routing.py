"""How the Ray server's router picks a replica for a request (server.routing).

- `least_loaded`: the live replica with the fewest waiting tokens as the router counts them
  (for each unfinished request it sent there: its prompt tokens until the first output, plus
  the output tokens it may still make), then the fewest requests; equal ones take turns.
- `prefix_aware`: the router also remembers, per replica, the block hashes of the prompts it
  sent there (a `PrefixIndex`, least recently used dropped past `server.routing_index_blocks`),
  and sends a request to the replica whose index holds the longest run of the request's
  leading blocks -- its KV cache most likely still holds them, so it skips their prefill --
  unless that replica is too busy:

      too busy:  load(best) > server.routing_max_imbalance x load(least loaded)
                              + server.routing_imbalance_slack_tokens

  in which case the least loaded replica takes it. The slack lets an idle cluster follow
  prefixes (any multiple of 0 is 0). Replicas that match equally take the least loaded of them.

The index is the router's guess, not the replicas' truth: a replica may have evicted blocks
its index still holds (the request then only misses), and the index never sees requests sent
by another router. A replica that dies or restarts loses its cache, so its index is dropped.
Hashes are core/block_hash.py's chains (rooted in the replica's model identity, salted by a
request's `cache_salt`), the same digests the engines compute. No Ray, no jax: tests build
replicas as plain objects.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from jaxcb.config import ServerConfig
from jaxcb.core.block_hash import BlockHash, block_hashes, model_root

ROUTING_MODES = ("least_loaded", "prefix_aware")


class Routable(Protocol):
    """What the choice reads off a replica (ray_server.RoutedReplica)."""

    index: int
    waiting_tokens: dict[str, int]  # request id -> tokens still to compute

    @property
    def load(self) -> int: ...


class RouteReason:
    """Why a request went where it went: the `reason` label of jaxcb:router_route_decisions."""

    PREFIX = "prefix"  # the replica with the longest tracked prefix
    IMBALANCE = "imbalance"  # a prefix was tracked, but its replica was too busy: the least loaded one
    LOAD = "load"  # no replica tracks any of its blocks (or routing=least_loaded): the least loaded one
    ONLY_REPLICA = "only_replica"  # one live replica to choose from


@dataclass(frozen=True)
class BlockHashSpec:
    """What a replica's block hashes are computed from: its KV-cache block size and chain root."""

    block_size: int
    root: BlockHash


@dataclass
class RoutingChoice:
    """Where one request goes, and what to remember once that replica has accepted it."""

    replica: Routable
    reason: str  # a RouteReason
    matched_tokens: int = 0  # leading prompt tokens the chosen replica's index holds (whole blocks)
    block_hashes: list[BlockHash] = field(default_factory=list)  # the prompt's full blocks, as that replica hashes them


class PrefixIndex:
    """The block hashes recently routed to one replica; past `max_blocks`, the least recently used go."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._hashes)

    def num_matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes` (a prompt's chain) the index holds, from the first up to the first miss."""
        num_matched = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            num_matched += 1
        return num_matched

    def record(self, hashes: Sequence[BlockHash]) -> None:
        """Remember a prompt's chain as just used.

        Touched last-first, so a chain's head (shared by more prompts) is always more recent
        than its tail: the LRU drops tails first, as the engines' block pools do, and never
        leaves a tail whose head is gone (a match stops at the first missing block)."""
        for block_hash in reversed(hashes):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_blocks:
            self._hashes.popitem(last=False)


def pick_least_loaded(live: Sequence[Routable], turn: int, num_replicas: int) -> Optional[Routable]:
    """The replica with the fewest waiting tokens, then the fewest requests; equal ones take turns."""
    if not live:
        return None
    return min(live, key=lambda r: (r.load, len(r.waiting_tokens), (r.index - turn) % num_replicas))


def is_too_busy(best: Routable, least_loaded: Routable, max_imbalance: float, slack_tokens: int) -> bool:
    """The longest-prefix replica is past the allowed imbalance (see the module docstring)."""
    return best.load > max_imbalance * least_loaded.load + slack_tokens


class ReplicaChooser:
    """The router's routing policy and its per-replica prefix indexes; see the module docstring."""

    def __init__(self, mode: str, num_replicas: int, *, index_blocks: int = 65536, max_imbalance: float = 2.0,
                 imbalance_slack_tokens: int = 2048):
        assert mode in ROUTING_MODES, mode  # config_validation refuses others by name
        self.mode = mode
        self.num_replicas = num_replicas
        self.index_blocks = index_blocks
        self.max_imbalance = max_imbalance
        self.imbalance_slack_tokens = imbalance_slack_tokens
        self.hash_specs: dict[int, BlockHashSpec] = {}  # replica index -> how its blocks hash
        self.indexes: dict[int, PrefixIndex] = {}  # replica index -> what was recently routed there
        self._turn = itertools.count()  # rotates ties among equally loaded replicas

    @property
    def prefix_aware(self) -> bool:
        return self.mode == "prefix_aware"

    def set_hash_spec(self, replica_index: int, spec: BlockHashSpec, index_blocks: Optional[int] = None) -> None:
        """How `replica_index` hashes its blocks; `index_blocks` bounds its index (default: the chooser's)."""
        self.hash_specs[replica_index] = spec
        self.indexes[replica_index] = PrefixIndex(index_blocks or self.index_blocks)

    def choose(self, live: Sequence[Routable], prompt_ids: Sequence[int],
               cache_salt: Optional[str] = None) -> Optional[RoutingChoice]:
        """Where a request with these prompt tokens goes among `live`; None if `live` is empty."""
        least = pick_least_loaded(live, next(self._turn), self.num_replicas)
        if least is None:
            return None
        if not self.prefix_aware:
            return RoutingChoice(least, RouteReason.ONLY_REPLICA if len(live) == 1 else RouteReason.LOAD)
        hashes_by_spec: dict[BlockHashSpec, list[BlockHash]] = {}  # replicas of one model share one chain
        matched: dict[int, int] = {}  # replica index -> matched blocks
        for replica in live:
            spec = self.hash_specs[replica.index]
            if spec not in hashes_by_spec:
                hashes_by_spec[spec] = block_hashes(prompt_ids, spec.block_size, spec.root, cache_salt)
            matched[replica.index] = self.indexes[replica.index].num_matched_blocks(hashes_by_spec[spec])

        def choice(replica: Routable, reason: str) -> RoutingChoice:
            spec = self.hash_specs[replica.index]
            return RoutingChoice(replica, reason, matched[replica.index] * spec.block_size, hashes_by_spec[spec])

        if len(live) == 1:
            return choice(least, RouteReason.ONLY_REPLICA)
        most = max(matched.values())
        if most == 0:
            return choice(least, RouteReason.LOAD)
        best = pick_least_loaded([r for r in live if matched[r.index] == most], next(self._turn), self.num_replicas)
        if is_too_busy(best, least, self.max_imbalance, self.imbalance_slack_tokens):
            return choice(least, RouteReason.IMBALANCE)
        return choice(best, RouteReason.PREFIX)

    def record(self, choice: RoutingChoice) -> None:
        """The chosen replica accepted the request: its prompt's blocks are now likely cached there."""
        if self.prefix_aware and choice.block_hashes:
            self.indexes[choice.replica.index].record(choice.block_hashes)

    def forget(self, replica_index: int) -> None:
        """The replica died or restarted: whatever its cache held is gone."""
        index = self.indexes.get(replica_index)
        if index is not None:
            self.indexes[replica_index] = PrefixIndex(index.max_blocks)


def make_chooser(srv: ServerConfig, model_name: str, replica_infos: Sequence[dict]) -> ReplicaChooser:
    """server.routing over replicas 0..N-1, each hashing blocks as its `ready` answer says."""
    chooser = ReplicaChooser(srv.routing, len(replica_infos), max_imbalance=srv.routing_max_imbalance,
                             imbalance_slack_tokens=srv.routing_imbalance_slack_tokens)
    for index, info in enumerate(replica_infos):
        root = info["prefix_cache_root"]
        if root is None:  # an engine without stable hashes: any root the router keeps to itself will do
            root = model_root({"model": model_name, "block_size": info["block_size"]})
        # The index models the replica's cache: by default as many blocks as that cache holds.
        chooser.set_hash_spec(index, BlockHashSpec(info["block_size"], root),
                              index_blocks=srv.routing_index_blocks or info["num_blocks"])
    return chooser
