"""The pallas form: attention through the Pallas (Triton backend) ragged paged-attention kernel.

The kernel, its reference and its tile planning are `pallas_kernels/` (no engine knowledge);
this module is what the attention protocol adds around it:

    cache layout  the shared `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`
                  (`cache.py`): one block of one head is the contiguous [block_size, head_dim]
                  tile the kernel gathers, and the layer scan passes the whole stacked cache
    K/V write     the shared scatter (`cache.scatter_kv_rows`), every row's before any attends
    prepare_step  the kernel's query-tile table, built once per step from the step's metadata;
                  every layer's kernel reads it (`AttentionMetadata.tiles`)
    attend        `ragged_paged_attention`, with that table (`interpret=True`: the Pallas
                  interpreter, for tests on CPU)

`pallas_form()` (`jaxcb.kernels.attention`) puts them together. The kernel's names are
re-exported here for the tests, benchmarks and GPU check that import them from this module.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.query_tiles import QueryTiles, choose_num_splits, kernel_tile_sizes, query_tiles, step_tile_table
from pallas_kernels.ragged_paged_attention import kernel_launches, ragged_paged_attention

__all__ = [
    "QueryTiles", "choose_num_splits", "kernel_launches", "kernel_tile_sizes", "prepare_step", "query_tiles",
    "ragged_paged_attention", "step_tile_table",
]


def prepare_step(md, *, num_tokens: int, group: int, block_size: int):
    """AttentionForm.prepare_step: the tile table built once per step; every layer's kernel reads it."""
    tiles = step_tile_table(md.query_start_loc, md.kv_lens, md.num_seqs, num_tokens=num_tokens, group=group,
                            block_size=block_size)
    return dataclasses.replace(md, tiles=tiles)
