"""Ragged paged attention: a Pallas (Triton backend) kernel, a plain-XLA path, and the reference both match.

All three take the same arguments: q [T, Hq, D], the stacked cache
[num_layers, num_kv_heads, num_blocks, block_size, head_dim] for K and V, kv_lens [R],
block_tables [R, W], query_start_loc [R + 1], num_seqs, layer; and sm_scale.
"""

from pallas_kernels.inputs import check_attention_inputs, check_batch_values
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

__all__ = [
    "check_attention_inputs",
    "check_batch_values",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
]
