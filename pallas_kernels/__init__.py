"""Paged-attention kernels and the pure-JAX reference each one is tested against."""

from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference"]
