"""Stable block hashes: how a full block is found, the same in every process, restart and host.

A block's K/V depend on its tokens, on every token before them (the parent block's hash) and
on what computes them: the model's architecture, its weights, the cache's dtype and block
size (the root). A tenant's `cache_salt` is folded into the chain's first link, so tenants
with different salts never share a block. Digests are xxhash's XXH3-128 over bytes (never
Python's `hash()`, which is seeded per process), so a router can compute a request's block
hashes from its token ids and the model's root without loading the model. No jax.

    root  = model_root({"architecture": ..., "weights": ..., "cache_dtype": ..., "block_size": ...})
    h[0]  = digest(root [+ salt] | tokens[0:bs])
    h[i]  = digest(h[i-1] | tokens[i*bs:(i+1)*bs])

XXH3 is fast, not collision-resistant: tokens can be crafted to share a digest. So a digest
only finds a candidate block; the block pool makes it a hit only if the block holds the same
tokens after the same parent and root (`BlockPool.find`). A forged collision costs its chain a
miss, never another chain's K/V. The Ray router's guesses rest on the digests alone: a forged
one can only send a request to another replica.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping, Optional, Sequence

import xxhash

BlockHash = bytes  # 16 bytes


def _digest(*parts: bytes) -> BlockHash:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two part lists share a byte stream
        h.update(part)
    return h.digest()


def model_root(identity: Mapping[str, Any]) -> BlockHash:
    """The chain's root: a digest of what computes the K/V (JSON-serialisable values, any key order)."""
    return _digest(b"jaxcb-block-hash-v1", json.dumps(identity, sort_keys=True, default=str).encode())


def salted_root(root: BlockHash, cache_salt: Optional[str]) -> BlockHash:
    """The root a request's chain starts from: the model's, or the model's with its tenant's salt."""
    return root if not cache_salt else _digest(root, b"cache_salt", cache_salt.encode())


def chain_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """One link: the hash of a full block of `token_ids` after the block hashed `parent`."""
    return _digest(parent, struct.pack(f"<{len(token_ids)}i", *token_ids))  # int32, little-endian


def block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash, cache_salt: Optional[str] = None,
                 ) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`, in order (a partial last block has none)."""
    parent, out = salted_root(root, cache_salt), []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
