"""The reference form: the pure-JAX definition of ragged paged attention, which every form is tested against.

The definition is the Pallas kernel's reference (`pallas_kernels/ragged_paged_attention.py`):
sequence r owns query tokens `query_start_loc[r]:query_start_loc[r+1]` and attends causally to
the first `kv_lens[r]` tokens of its context, new tokens included, through its row of
`block_tables`; padding tokens return 0; blocks outside a context never contribute, even NaN.
With a sliding window (`window`, i32[]) a token at position p sees only keys p - window < j <= p;
`NO_WINDOW` is none. With a logit soft-cap (`softcap`, a static float c) each score becomes
c * tanh(score / c) before the masks. O(tokens x context): for tests, not speed.
"""

from __future__ import annotations

from pallas_kernels.ragged_paged_attention import NO_WINDOW, ragged_paged_attention_reference

__all__ = ["NO_WINDOW", "ragged_paged_attention_reference"]
