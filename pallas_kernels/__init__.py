"""Pallas kernels, with no engine knowledge: each takes arrays and static sizes, returns arrays.

    ragged_paged_attention.py  attention of a ragged prefill/decode batch over a paged KV cache,
                               Triton backend (GPU, or the Pallas interpreter); its reference,
                               checks, kernel and jitted wrapper
    query_tiles.py             how that kernel cuts a step into programs: tile sizes, launch grid,
                               the per-step tile table (pure jax.numpy)

A kernel file reads top to bottom: docstring, pure-JAX reference, shape/dtype checks, kernel,
jitted wrapper. Nothing here imports jaxcb; jaxcb's attention forms import these. Import a
kernel from its module (`from pallas_kernels.ragged_paged_attention import ragged_paged_attention`):
the package re-exports nothing, so a module's name is never shadowed by its function's.
"""
