"""Host-side bookkeeping of the paged KV cache's blocks: which are free, and who holds the rest.

The pool owns block ids, never device memory (that is `kv_cache.py`), and imports no jax:
the scheduler calls it every step. Block 0 is the null block and is never handed out.

- Free blocks wait in a queue kept in eviction order: allocation takes from the front, a
  freed block goes to the back. Once prefix caching keeps the contents of freed blocks
  for reuse, the front is the least recently used; a hit removes a block from the middle
  of the queue in O(1), hence the ordered dict.
- Each handed-out block has a reference count: 1 for its owner, +1 for every sequence
  that shares it (`fork`, for n > 1 samples now and shared prefixes later). It returns
  to the free queue when the count reaches 0.
- Prefix caching: a full block can be registered under the hash of its contents (a 16-byte
  digest chained from the parent block's hash, `block_hash.py`), with the contents themselves:
  its tokens and what they follow (its parent's content id, or the chain's root key). The hash
  only finds a candidate; `find` returns it only if its tokens and parent are the ones asked for,
  so a hit never rests on the hash alone (XXH3 is fast, not collision-resistant: crafted tokens
  can share a digest). Content ids are never reused, so a child names the exact registration of
  its parent, not a block id that eviction hands to other tokens. A freed registered block keeps
  its contents and its hash while it waits in the free queue; `find` finds it and `touch` takes
  it back out. It is evicted -- its hash forgotten -- only when `allocate` needs it as a fresh
  block, least recently freed first. A block in use is never in the queue, so never evicted.
- Every operation checks all of its arguments before it changes anything, so a bad call
  raises and leaves the pool as it was.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Optional, Sequence

from jaxcb.core.block_hash import BlockHash

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free; nothing was allocated."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"asked for {requested} KV cache blocks but only {available} are free")
        self.requested = requested
        self.available = available


class BlockPoolError(ValueError):
    """A call that would corrupt the pool (double free, unknown block); nothing was changed."""


class CachedBlock(NamedTuple):  # a tuple: one is made for every block registered
    """A registered block's contents: `token_ids` after the contents `parent` names."""

    block: int
    block_hash: BlockHash
    parent: Hashable  # the content id of the block before it, or (first block) the chain's root key
    token_ids: tuple[int, ...]
    content_id: int  # unique for the pool's lifetime: what a child block's `parent` names


@dataclass(frozen=True)
class BlockPoolUsage:
    num_used_blocks: int
    num_free_blocks: int
    num_usable_blocks: int  # all blocks but the null block

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1 (the kv_cache_usage_perc metric)."""
        return self.num_used_blocks / self.num_usable_blocks


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2: block 0 is the reserved null block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[int, CachedBlock] = {}  # registered block -> its contents
        self._block_of_hash: dict[BlockHash, int] = {}
        # Held blocks that are not registered but hold the same contents as a registered one (the
        # same prefix computed twice): their children name that one's content id.
        self._same_as: dict[int, int] = {}
        self._content_ids = itertools.count(1)
        self.num_evictions = 0
        # With a host tier (KVCacheManager), the registered blocks `allocate` evicted, until it takes them.
        self.keep_evicted = False
        self.evicted: list[CachedBlock] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> BlockPoolUsage:
        usable = self.num_blocks - 1
        return BlockPoolUsage(usable - len(self._free), len(self._free), usable)

    def ref_count(self, block: int) -> int:
        self._check_ids([block])
        return self._ref_counts[block]

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks with reference count 1, ascending, or NoFreeBlocksError and no change."""
        if num_blocks < 0:
            raise BlockPoolError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(num_blocks, len(self._free))
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        # Which blocks are taken follows the eviction order; the order they are handed out in does
        # not matter to it. Ascending, a run of consecutive free blocks -- a sequence freed last
        # block first comes back as one -- is read forwards through memory.
        return sorted(blocks)

    # --- prefix caching --------------------------------------------------------------------------

    def register(self, block: int, block_hash: BlockHash, parent: Hashable, token_ids: Sequence[int],
                 content_id: Optional[int] = None) -> Optional[int]:
        """Remember that held `block` is (or, by the end of the step being built, will be) full of
        `token_ids` after the contents `parent` names; return the content id its children name as
        their parent. A hash already registered keeps its first block: the same contents computed
        twice are cached once (the second block takes the first one's content id), and other
        contents under the same hash (a collision) are not cached at all (None: nothing that
        follows this block can be cached either). `content_id`: contents coming back from the host
        tier keep the id their children there name."""
        self._check_held([block])
        token_ids = tuple(token_ids)
        entry = self._cached.get(block)  # registered already (by another holder of the block)
        if entry is None and block_hash not in self._block_of_hash:
            cid = content_id if content_id is not None else next(self._content_ids)
            entry = self._cached[block] = CachedBlock(block, block_hash, parent, token_ids, cid)
            self._block_of_hash[block_hash] = block
            return entry.content_id
        if entry is None:
            entry = self._cached[self._block_of_hash[block_hash]]
        if entry.parent != parent or entry.token_ids != token_ids:
            return None
        if entry.block != block:
            self._same_as[block] = entry.content_id
        return entry.content_id

    def is_registered(self, block: int) -> bool:
        return block in self._cached

    def hash_of(self, block: int) -> Optional[BlockHash]:
        """The hash `block` is registered under, or None."""
        entry = self._cached.get(block)
        return entry.block_hash if entry is not None else None

    def cached_block(self, block: int) -> Optional[CachedBlock]:
        """What registered `block` holds, or None."""
        return self._cached.get(block)

    def content_id(self, block: int) -> Optional[int]:
        """The content id of what held `block` holds, if the cache knows it (registered, or the same
        contents as a registered block); None if not (never registered, or its hash collided)."""
        entry = self._cached.get(block)
        return entry.content_id if entry is not None else self._same_as.get(block)

    def find(self, block_hash: BlockHash, parent: Hashable, token_ids: Sequence[int]) -> Optional[CachedBlock]:
        """The block, in use or free, caching `token_ids` after the contents `parent` names, or None.
        The hash picks the candidate; its tokens and parent decide."""
        block = self._block_of_hash.get(block_hash)
        if block is None:
            return None
        entry = self._cached[block]
        if entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None  # another chain's block under the same hash
        return entry

    def touch(self, blocks: Sequence[int]) -> list[int]:
        """Take cached blocks for one more holder: out of the free queue if unreferenced, count + 1."""
        self._check_ids(blocks)
        for block in blocks:
            if block == NULL_BLOCK or (self._ref_counts[block] == 0 and block not in self._cached):
                raise BlockPoolError(f"block {block} is neither held nor cached; it cannot be touched")
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        return list(blocks)

    def _evict(self, block: int) -> None:
        entry = self._cached.pop(block, None)
        if entry is not None:
            del self._block_of_hash[entry.block_hash]
            self.num_evictions += 1
            if self.keep_evicted:
                self.evicted.append(entry)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def fork(self, blocks: Sequence[int]) -> list[int]:
        """Share blocks with one more holder (reference count + 1); returns the same ids."""
        self._check_held(blocks)
        for block in blocks:
            self._ref_counts[block] += 1
        return list(blocks)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks that reach 0 join the back of the free queue.

        A sequence's blocks are released last-first, so that its tail -- the part least
        likely to be shared -- is evicted before its head.
        """
        self._check_held(blocks)
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
            if counts[block] > self._ref_counts[block]:
                raise BlockPoolError(f"block {block} freed more times than it is held ({self._ref_counts[block]})")
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self._same_as.pop(block, None)  # unregistered: its contents are forgotten

    def _check_ids(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise BlockPoolError(f"block {block} is not in this pool of {self.num_blocks} blocks")

    def _check_held(self, blocks: Sequence[int]) -> None:
        self._check_ids(blocks)
        for block in blocks:
            if block == NULL_BLOCK:
                raise BlockPoolError("the null block (0) is never allocated, shared or freed")
            if self._ref_counts[block] == 0:
                raise BlockPoolError(f"block {block} is free; it cannot be shared or freed again")

    def check_invariants(self) -> None:
        """Every non-null block is either free (count 0, queued once) or held (count > 0, not queued)."""
        for block in range(1, self.num_blocks):
            held = self._ref_counts[block] > 0
            assert held != (block in self._free), f"block {block}: count {self._ref_counts[block]}, queued {not held}"
        assert self._ref_counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free
        for block_hash, block in self._block_of_hash.items():
            assert self._cached[block].block_hash == block_hash and self._cached[block].block == block
        assert len(self._cached) == len(self._block_of_hash)
        for block in self._same_as:
            assert self._ref_counts[block] > 0 and block not in self._cached, f"block {block}"
