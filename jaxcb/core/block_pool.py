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
  digest chained from the parent block's hash, `block_hash.py`). A freed registered block keeps
  its contents and its hash while it waits in the free queue; `lookup` finds it and `touch`
  takes it back out. It is evicted -- its hash forgotten -- only when `allocate` needs it as a
  fresh block, least recently freed first. A block in use is never in the queue, so never evicted.
- Every operation checks all of its arguments before it changes anything, so a bad call
  raises and leaves the pool as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

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
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}
        self.num_evictions = 0

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

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Remember that held `block` is (or, by the end of the step being built, will be) full of
        the tokens `block_hash` stands for. A hash already registered keeps its first block: the
        same prefix computed twice is cached once."""
        self._check_held([block])
        if block_hash in self._block_of_hash or block in self._hash_of_block:
            return
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of_block

    def hash_of(self, block: int) -> Optional[BlockHash]:
        """The hash `block` is registered under, or None."""
        return self._hash_of_block.get(block)

    def lookup(self, block_hash: BlockHash) -> Optional[int]:
        """The block caching `block_hash`, in use or free, or None."""
        return self._block_of_hash.get(block_hash)

    def touch(self, blocks: Sequence[int]) -> list[int]:
        """Take cached blocks for one more holder: out of the free queue if unreferenced, count + 1."""
        self._check_ids(blocks)
        for block in blocks:
            if block == NULL_BLOCK or (self._ref_counts[block] == 0 and block not in self._hash_of_block):
                raise BlockPoolError(f"block {block} is neither held nor cached; it cannot be touched")
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        return list(blocks)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self.num_evictions += 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of_block)

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
            assert self._hash_of_block[block] == block_hash
