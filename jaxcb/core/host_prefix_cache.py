"""The prefix cache's host tier: registered blocks the device pool evicts, kept in host memory (no jax).

When the device pool hands a free registered block to new tokens (`BlockPool.allocate` evicts
it), the KV-cache manager offers its contents here: a host block is taken (a free one, else the
least recently used entry's), the device block's K/V are copied into it before the step that
overwrites it (the runner's `HostBlocks.offload`, which does not wait for the copy), and the entry
stays findable under the same hash, parent and tokens -- the same collision-proof check as a
device hit (`BlockPool.find`) -- and the same content id, so that a chain whose head is on the
device and tail on the host (or the reverse) still links.

A prefix lookup (`KVCacheManager.cached_prefix`) asks here for each block the device does not
hold; a host hit comes back into a fresh device block through the copy path swap-in uses, and
counts as computed tokens. A block being read back is held: no offload takes it before the
runner has copied it (the copy happens when the step is dispatched, before any later offload
lands). Its own LRU: a hit or an insert makes an entry the most recent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

from jaxcb.core.block_hash import BlockHash
from jaxcb.core.block_pool import CachedBlock


class HostPrefixCache:
    """`num_blocks` host blocks (ids 1..num_blocks-1; 0 unused, like the device pool's null block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2: host block 0 is unused")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: lowest id first
        self._entries: OrderedDict[int, CachedBlock] = OrderedDict()  # host block -> contents, LRU first
        self._by_hash: dict[BlockHash, int] = {}
        self._held: dict[int, int] = {}  # host block -> pending reads
        self.num_evictions = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    def find(self, block_hash: BlockHash, parent: Hashable, token_ids: Sequence[int]) -> Optional[CachedBlock]:
        """The entry caching `token_ids` after `parent` (its `block` is the host block), or None; a hit is
        made the most recently used."""
        host = self._by_hash.get(block_hash)
        if host is None:
            return None
        entry = self._entries[host]
        if entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None
        self._entries.move_to_end(host)
        return entry

    def insert(self, evicted: CachedBlock) -> Optional[int]:
        """Take the contents of an evicted device block: the host block to copy it into, or None when the
        hash is here already (nothing to copy) or every host block is held."""
        if evicted.block_hash in self._by_hash:
            self._entries.move_to_end(self._by_hash[evicted.block_hash])
            return None
        host = self._take()
        if host is None:
            return None
        self._entries[host] = evicted._replace(block=host)
        self._by_hash[evicted.block_hash] = host
        return host

    def _take(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for host in self._entries:  # least recently used first
            if host not in self._held:
                entry = self._entries.pop(host)
                del self._by_hash[entry.block_hash]
                self.num_evictions += 1
                return host
        return None

    def hold(self, blocks: Sequence[int]) -> None:
        """Keep `blocks` from being reused until `release`: the runner has yet to read them."""
        for host in blocks:
            if host not in self._entries:
                raise ValueError(f"host block {host} holds no cached contents")
            self._held[host] = self._held.get(host, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        for host in blocks:
            left = self._held[host] - 1
            if left:
                self._held[host] = left
            else:
                del self._held[host]

    @property
    def num_held(self) -> int:
        return len(self._held)

    def check_invariants(self) -> None:
        assert len(self._entries) + len(self._free) == self.num_blocks - 1
        assert set(self._entries).isdisjoint(self._free)
        for block_hash, host in self._by_hash.items():
            assert self._entries[host].block_hash == block_hash and self._entries[host].block == host
        assert len(self._by_hash) == len(self._entries)
        assert set(self._held) <= set(self._entries)
