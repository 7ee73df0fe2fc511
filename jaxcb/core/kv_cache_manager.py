"""The KV-cache manager: which device (and host) blocks each sequence holds (no jax).

Between the scheduler, which decides who computes what, and the block pool, which hands out
blocks: the manager allocates a sequence's blocks as its tokens grow, frees them, moves a
preempted sequence's blocks to host memory and back (swap), recording the copies the runner
makes before the next step, and keeps the prefix cache:

- a full block is found by a stable digest of its tokens chained from its parent block's,
  rooted in the model's identity (`root`) and the request's tenant `cache_salt`
  (`block_hash.py`), and is a hit only if it holds the same tokens after the same parent
  (`BlockPool.find`): the first block of a chain follows its root key -- the model's root, the
  salt, and with caching off the n > 1 group -- the others their parent's content id. So no
  tokens crafted to share a digest (XXH3 is not collision-resistant) get another chain's K/V,
  and requests with different salts never share a block;
- `cached_prefix` finds the longest run of a new sequence's full blocks that some block holds;
- `register_full_blocks` makes a sequence's full blocks findable from the moment the step that
  fills them is built -- a later sequence of the same step attends to them, which is sound
  because every attention form writes a step's K/V before any row reads the cache
  (`jaxcb.kernels.attention`). A block is full only when the host knows all its tokens: one
  whose last token is still in flight (async scheduling) waits until that token arrives, and
  a token in flight is never hashed.

With prefix caching off, the n sequences of one request (n > 1) still share their prompt's
blocks through the same mechanism, in a chain rooted in their own group that nothing else finds.

With a host tier (`cache.host_prefix_cache_gib`, `host_prefix_cache.py`), a registered block the
device pool evicts is copied to a host block first (`offload`, before the step that overwrites
it), and `cached_prefix` continues into the host tier where the device misses: a host hit takes
a fresh device block at admission, filled from the host (`restore`) before the step.

The scheduler counts tokens, never blocks: it asks the manager whether a sequence fits
(`can_admit`: its cached prefix plus fresh blocks for its first tokens, also a swapped-out
sequence's return with no prefix), to admit it (`admit`, `swap_in_blocks`), to give a running
sequence room for its next tokens or say it cannot (`allocate`: all or nothing), and to take a
victim's blocks back (`preempt`). Only the manager talks to the block pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Optional

from jaxcb.core.block_hash import BlockHash, chain_hash, salted_root
from jaxcb.core.block_pool import BlockPool, CachedBlock, NoFreeBlocksError
from jaxcb.core.host_prefix_cache import HostPrefixCache
from jaxcb.core.in_flight import InFlightTokens
from jaxcb.core.sequence import Sequence

# Unique across requests and managers: a request id may come back (a client reusing it) and must
# not find the table the runner kept for the last request of that name.
_block_epochs = itertools.count(1)

NO_ROOT = bytes(16)  # the root of a manager told nothing of its model (tests of the scheduler alone)


@dataclass(frozen=True)
class CachedPrefix:
    """A waiting sequence's leading full blocks found in the prefix cache (`cached_prefix`)."""

    block_ids: tuple[int, ...] = ()  # the device blocks found
    num_tokens: int = 0  # the tokens they hold, which the sequence need not compute
    # The whole prefix in order: (device block, None) or (None, host entry) for a block found in the host tier.
    blocks: tuple[tuple[Optional[int], Optional[CachedBlock]], ...] = ()

    @property
    def num_host_blocks(self) -> int:
        return sum(1 for _, entry in self.blocks if entry is not None)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, *, enable_prefix_caching: bool = False,
                 root: BlockHash = NO_ROOT, host_pool: Optional[BlockPool] = None, block_growth: int = 1,
                 growth_reserve: int = 0, max_model_len: Optional[int] = None,
                 host_cache: Optional[HostPrefixCache] = None):
        self.pool = pool
        self.block_size = block_size
        # A decoding sequence that needs a block takes block_growth at once, while more than
        # growth_reserve blocks would stay free (cache.block_growth).
        self.block_growth = block_growth
        self.growth_reserve = growth_reserve
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.host_pool = host_pool  # swap space (preemption_mode=swap)
        self.root = root  # the model's identity: what else the K/V depend on (Engine.prefix_cache_root)
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self.swap_in: list[tuple[int, int]] = []  # (host block, device block) copies before the next step
        self.swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        # The prefix cache's host tier (None: off): evicted registered blocks offloaded, found, restored.
        self.host_cache = host_cache if enable_prefix_caching else None
        pool.keep_evicted = self.host_cache is not None
        self.offload: list[tuple[int, int]] = []  # (device block, host block) copies before the next step
        self.restore: list[tuple[int, int]] = []  # (host block, device block) copies before the next step
        self.host_prefix_hits = 0  # tokens found in the host tier (also counted in prefix_cache_hits)
        self.num_offloaded_blocks = 0
        self.num_restored_blocks = 0

    # --- device blocks: the scheduler's questions --------------------------------------------------

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request: Sequence, num_tokens: int) -> int:
        """Blocks `request` lacks to hold `num_tokens` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(request.block_ids))

    def can_admit(self, prefix: CachedPrefix, num_tokens: int) -> bool:
        """Whether a sequence that holds no blocks yet fits its first `num_tokens` tokens: the blocks
        of `prefix` (found by `cached_prefix`), then fresh ones from the free blocks -- less the
        prefix's own cached blocks that are free now (taking them takes them out of the free queue)."""
        needed = max(0, self.num_blocks_for(num_tokens) - len(prefix.block_ids))  # host hits take fresh ones
        reused_free = sum(1 for block in prefix.block_ids if self.pool.ref_count(block) == 0)
        return needed <= self.pool.num_free_blocks - reused_free

    def admit(self, request: Sequence, prefix: CachedPrefix, num_tokens: int) -> None:
        """A waiting sequence starts with room for its first `num_tokens` tokens: the blocks found in
        the prefix cache, then fresh ones. The caller asked `can_admit` first (NoFreeBlocksError if not)."""
        num_new = max(0, self.num_blocks_for(num_tokens) - len(prefix.block_ids))
        if not self.can_admit(prefix, num_tokens):  # before anything changes: the prefix is taken first
            raise NoFreeBlocksError(num_new, self.pool.num_free_blocks)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix.num_tokens
        if not prefix.num_host_blocks:
            # The prefix first: a fresh allocation could otherwise evict its cached, unreferenced blocks.
            request.block_ids = self.pool.touch(list(prefix.block_ids)) + self._allocate(num_new)
        else:
            request.block_ids = self._admit_with_host_hits(prefix, num_new)
            self.host_prefix_hits += prefix.num_host_blocks * self.block_size
        request.block_epoch = next(_block_epochs)
        request.num_registered_blocks = len(prefix.blocks) if prefix.blocks else len(prefix.block_ids)

    def _admit_with_host_hits(self, prefix: CachedPrefix, num_new: int) -> list[int]:
        """The block table of a prefix found partly in the host tier: its device blocks taken, a fresh
        device block for each host hit (filled from the host before the step, and registered with the
        contents it gets), then the fresh blocks past the prefix."""
        self.pool.touch(list(prefix.block_ids))
        hosts = [entry.block for block, entry in prefix.blocks if entry is not None]
        self.host_cache.hold(hosts)  # no offload of this allocation may take them before the copy
        fresh = iter(self._allocate(num_new))
        table = []
        for block, entry in prefix.blocks:
            if entry is not None:
                block = next(fresh)
                self.restore.append((entry.block, block))
                self.pool.register(block, entry.block_hash, entry.parent, entry.token_ids, entry.content_id)
            table.append(block)
        self.num_restored_blocks += len(hosts)
        return table + list(fresh)

    def _allocate(self, num_blocks: int) -> list[int]:
        """Fresh device blocks; with a host tier, the registered blocks that taking them evicts are offloaded."""
        blocks = self.pool.allocate(num_blocks)
        if self.host_cache is not None and self.pool.evicted:
            for entry in self.pool.evicted:
                host = self.host_cache.insert(entry)
                if host is not None:
                    self.offload.append((entry.block, host))
                    self.num_offloaded_blocks += 1
            self.pool.evicted.clear()
        return blocks

    def allocate(self, request: Sequence, num_new: int) -> bool:
        """Give running `request` room for its next `num_new` tokens (a decoding sequence: up to a run
        of block_growth blocks); False, taking nothing, if too few blocks are free."""
        needed = self.num_blocks_needed(request, request.num_computed_tokens + num_new)
        if needed == 0:
            return True
        try:
            # A new list, never the old one extended: a step scheduled before holds that one as it was.
            request.block_ids = request.block_ids + self._allocate(needed + self._growth_extra(request, needed))
        except NoFreeBlocksError:
            return False
        return True

    def _growth_extra(self, request: Sequence, needed: int) -> int:
        """Blocks a decoding sequence takes beyond those it needs now, to grow by a run of
        block_growth: decodes that grow side by side, a block each in turn, would otherwise
        scatter every table over the whole cache, and the CPU attention kernel reads scattered
        blocks up to 1.6x slower than consecutive ones (`benchmarks/attention_block_layout.py`).
        None past the last block the sequence can reach, and none unless more than growth_reserve
        blocks stay free: spare blocks never cost another sequence its place."""
        if needed >= self.block_growth or request.is_prefilling:
            return 0
        reach = request.num_prompt_tokens + request.sampling_params.max_tokens
        if self.max_model_len is not None:
            reach = min(reach, self.max_model_len)
        extra = min(self.block_growth - needed, self.num_blocks_for(reach) - len(request.block_ids) - needed)
        if extra <= 0 or self.pool.num_free_blocks - needed - extra < self.growth_reserve:
            return 0
        return extra

    def release_blocks_past(self, request: Sequence, num_blocks: int) -> None:
        """Free the running sequence's blocks after its first `num_blocks` (those only rejected
        speculative drafts needed). None of them is registered: they hold no known token."""
        if len(request.block_ids) <= num_blocks:
            return
        assert request.num_registered_blocks <= num_blocks, (request.seq_id, num_blocks)
        self.pool.free(request.block_ids[num_blocks:])
        request.block_ids = request.block_ids[:num_blocks]  # a new list: a built step keeps the one it had
        kept = request.num_blocks_kept
        request.num_blocks_kept = num_blocks if kept is None else min(kept, num_blocks)

    def free(self, request: Sequence) -> None:
        """Every block the sequence holds, on the device and on the host."""
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
            request.block_epoch = next(_block_epochs)
        if request.host_block_ids:
            self.host_pool.free(request.host_block_ids)
            request.host_block_ids = []

    def preempt(self, victim: Sequence, swap: bool) -> bool:
        """Take a running sequence's device blocks back: with `swap`, its computed tokens' blocks go to
        host memory first (`try_swap_out`); else, or if the host pool is full, they are freed and it
        recomputes. True if it was swapped. Either way it registers its blocks again when it returns."""
        swapped = swap and self.try_swap_out(victim)
        if not swapped:
            self.free(victim)
        victim.num_registered_blocks = 0
        return swapped

    # --- swap ------------------------------------------------------------------------------------

    def try_swap_out(self, victim: Sequence) -> bool:
        """Copy the blocks holding the victim's computed tokens to host blocks (the runner does it
        before this step's writes can reuse them) and free its device blocks; False if the host
        pool cannot take them (then the caller recomputes)."""
        num_kept = self.num_blocks_for(victim.num_computed_tokens)
        if self.host_pool is None or not 0 < num_kept <= self.host_pool.num_free_blocks:
            return False
        host = self.host_pool.allocate(num_kept)
        self.swap_out += list(zip(victim.block_ids[:num_kept], host))
        self.pool.free(victim.block_ids)
        victim.block_ids = []
        victim.block_epoch = next(_block_epochs)
        victim.host_block_ids = host
        self.num_swap_outs += 1
        return True

    def swap_in_blocks(self, request: Sequence, num_tokens: int) -> None:
        """A swapped-out sequence returns with room for its first `num_tokens` tokens: fresh device
        blocks, its host blocks copied into them before the next step. The caller asked
        `can_admit(CachedPrefix(), num_tokens)` first."""
        request.block_ids = self._allocate(self.num_blocks_for(num_tokens))
        request.block_epoch = next(_block_epochs)
        self.swap_in += list(zip(request.host_block_ids, request.block_ids))
        self.host_pool.free(request.host_block_ids)
        request.host_block_ids = []
        self.num_swap_ins += 1

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap_in, swap_out) copies recorded since the last step, and forget them."""
        swaps = (self.swap_in, self.swap_out)
        self.swap_in, self.swap_out = [], []
        return swaps

    def take_host_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(restore, offload) copies of the host tier recorded since the last step, and forget them. The
        runner makes them when it dispatches the step, reading the restored host blocks then, so they
        are released here."""
        copies = (self.restore, self.offload)
        if self.restore:
            self.host_cache.release([host for host, _ in self.restore])
        self.restore, self.offload = [], []
        return copies

    # --- the prefix cache -----------------------------------------------------------------------

    def _shares(self, request: Sequence) -> bool:
        return self.enable_prefix_caching or request.sampling_params.n > 1

    def _group(self, request: Sequence) -> Optional[Hashable]:
        """Caching off: the request (n > 1) whose sequences alone find each other's blocks."""
        if self.enable_prefix_caching:
            return None
        return request.parent_id if request.parent_id is not None else request.seq_id

    def _chain_root(self, request: Sequence) -> BlockHash:
        root = salted_root(self.root, request.cache_salt)
        if request.lora_identity is not None:  # an adapter's K/V are its own: never another's or the base's
            root = salted_root(root, f"jaxcb-lora {request.lora_identity}")
        group = self._group(request)
        return root if group is None else salted_root(root, f"jaxcb-n-group {group!r}")

    def _root_key(self, request: Sequence) -> tuple:
        """What a chain's first block follows, compared exactly on a hit (its digest is _chain_root)."""
        return (self.root, request.cache_salt, request.lora_identity, self._group(request))

    def cached_prefix(self, request: Sequence) -> CachedPrefix:
        """The longest cached prefix of the request's known full blocks, leaving its last token (and
        with it the block it sits in) to compute."""
        if not self._shares(request):
            return CachedPrefix()
        num_blocks = min(request.num_tokens - 1, InFlightTokens.num_known_tokens(request)) // self.block_size
        hits, parent, bs, host = [], self._root_key(request), self.block_size, self.host_cache
        for i, block_hash in enumerate(self._block_hashes(request, num_blocks)):
            token_ids = request.token_ids(i * bs, (i + 1) * bs)
            cached = self.pool.find(block_hash, parent, token_ids)
            if cached is not None:
                hits.append((cached.block, None))
            elif host is not None and (cached := host.find(block_hash, parent, token_ids)) is not None:
                hits.append((None, cached))
            else:
                break
            parent = cached.content_id
        device = tuple(block for block, _ in hits if block is not None)
        if len(device) == len(hits):
            return CachedPrefix(device, len(hits) * bs)
        return CachedPrefix(device, len(hits) * bs, tuple(hits))

    def _block_hashes(self, request: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first num_blocks full blocks, each computed once per sequence."""
        chain = request.block_hashes
        bs = self.block_size
        while len(chain) < num_blocks:
            i = len(chain)
            token_ids = request.token_ids(i * bs, (i + 1) * bs)
            assert not InFlightTokens.any_in_flight(token_ids), f"{request.seq_id}: hashing a token in flight"
            chain.append(chain_hash(chain[-1] if chain else self._chain_root(request), token_ids))
        return chain[:num_blocks]

    def register_full_blocks(self, request: Sequence, num_tokens: int) -> None:
        """Make findable the blocks that the sequence's first `num_tokens` tokens fill, stopping at
        the first one that holds a token still in flight.

        The caller guarantees those tokens' K/V are in the cache or will be written by the step
        being built (whose SchedulerOutput is dispatched before any later step): the scheduler calls
        this once a sequence's share of the step is final, and again when tokens in flight arrive.
        `num_registered_blocks` then counts the blocks the cache was offered, including any that
        were not cacheable (other contents under their hash)."""
        if num_tokens // self.block_size <= request.num_registered_blocks or not self._shares(request):
            return  # the common case first: a decode token that fills no block
        num_full = min(num_tokens, InFlightTokens.num_known_tokens(request)) // self.block_size
        assert num_full <= len(request.block_ids), (request.seq_id, num_tokens, request.block_ids)
        if num_full <= request.num_registered_blocks:
            return
        chain, first, bs = self._block_hashes(request, num_full), request.num_registered_blocks, self.block_size
        # What the first new block follows. None: the block before it holds contents the cache does not
        # know (its hash was another chain's), so nothing after it can be found either.
        parent = self._root_key(request) if first == 0 else self.pool.content_id(request.block_ids[first - 1])
        for i in range(first, num_full):
            if parent is None:
                break
            parent = self.pool.register(request.block_ids[i], chain[i], parent, request.token_ids(i * bs, (i + 1) * bs))
        request.num_registered_blocks = num_full
