"""Checks shared by every ragged paged-attention form.

Shapes and dtypes: `check_attention_inputs`, the Pallas kernel's own checks
(`pallas_kernels/ragged_paged_attention.py`), which every form runs. Values (lengths against
table widths, block ids in range) cannot be checked inside jit; `check_batch_values` does that
on host arrays for tests and debugging.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.ragged_paged_attention import SUPPORTED_BLOCK_SIZES, check_attention_inputs

__all__ = ["SUPPORTED_BLOCK_SIZES", "check_attention_inputs", "check_batch_values"]


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
