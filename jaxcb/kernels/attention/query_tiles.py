"""Query tiles of a ragged batch, one sequence each: the Pallas kernel's (`pallas_kernels/query_tiles.py`).

The XLA form cuts every sequence at one tile size (`query_tile_table`); the kernel gives decodes
small tiles and prefill chunks large ones (`two_class_tile_table`).
"""

from __future__ import annotations

from pallas_kernels.query_tiles import max_query_tiles, query_tile_table, two_class_tile_table

__all__ = ["max_query_tiles", "query_tile_table", "two_class_tile_table"]
