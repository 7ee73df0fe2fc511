"""Checks shared by every ragged paged-attention implementation: shapes and dtypes, named in the message.

Values (lengths against table widths, block ids in range) cannot be checked inside jit;
`check_batch_values` does that on host arrays for tests and debugging.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)


def check_attention_inputs(
    q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, layer, *, q_may_differ_from_cache=False
) -> None:
    """Shape and dtype checks with messages that name the offending argument. An implementation
    that reads the cache in one dtype and computes in q's passes q_may_differ_from_cache."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {q.shape=}")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_layers, num_kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_cache.shape=} {v_cache.shape=}"
        )
    _, num_kv_heads, _, block_size, head_dim = k_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim} ({q.shape=}, {k_cache.shape=})")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads={q.shape[1]} must be a multiple of num_kv_heads={num_kv_heads}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{block_size=} must be one of {SUPPORTED_BLOCK_SIZES}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must equal v_cache dtype {v_cache.dtype}")
    if q.dtype != k_cache.dtype and not q_may_differ_from_cache:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq], got {block_tables.shape=}")
    num_seqs_max = block_tables.shape[0]
    if kv_lens.shape != (num_seqs_max,):
        raise ValueError(f"kv_lens must be [{num_seqs_max}] like block_tables' rows, got {kv_lens.shape=}")
    if query_start_loc.shape != (num_seqs_max + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs_max + 1}], got {query_start_loc.shape=}")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("num_seqs", num_seqs), ("layer", layer)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_batch_values(
    kv_lens, block_tables, query_start_loc, num_seqs, *, num_tokens: int, num_blocks: int, block_size: int
) -> None:
    """Host-side value checks of one batch's metadata (numpy arrays): what jit cannot check."""
    kv_lens, block_tables, qsl = np.asarray(kv_lens), np.asarray(block_tables), np.asarray(query_start_loc)
    n = int(num_seqs)
    if not 0 <= n <= block_tables.shape[0]:
        raise ValueError(f"num_seqs={n} must be in [0, {block_tables.shape[0]}]")
    if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[n] > num_tokens:
        raise ValueError(f"query_start_loc must start at 0, never decrease and end <= {num_tokens}: {qsl}")
    q_lens = np.diff(qsl)[:n]
    if np.any(q_lens > kv_lens[:n]):
        raise ValueError(f"each sequence's new tokens are part of its context: q_lens={q_lens} > kv_lens={kv_lens[:n]}")
    capacity = block_tables.shape[1] * block_size
    if np.any(kv_lens[:n] > capacity):
        raise ValueError(
            f"kv_lens up to {kv_lens[:n].max()} do not fit a block table of {block_tables.shape[1]} blocks "
            f"x {block_size} tokens = {capacity}"
        )
    if np.any(block_tables < 0) or np.any(block_tables >= num_blocks):
        raise ValueError(f"block_tables entries must be in [0, {num_blocks})")
