"""Reading an optimised HLO module for copies of one layer's weights.

A scanned layer loop takes its weights stacked on a leading [L] axis; the loop body cuts layer i out
with a dynamic-slice. Where that slice stays a top-level instruction, XLA writes the layer's weights
to a new buffer every layer of every step (XLA:CPU does: ~300 MB a step on `small`); where it sits
inside a fusion (a GPU gemm fusion reading its operand at an offset) the weights are read in place.
tests/test_layer_loop.py pins the CPU step; scripts/gpu_stages.py reports the GPU one.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

# `%name = bf16[1,4096,1,48,128]{4,3,2,1,0} dynamic-slice(` -> dtype, dims, op
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_FUSION_CALLS = re.compile(r"\bfusion\(.*\bcalls=%?([\w.\-]+)")
# what only names, reshapes or forwards a buffer: not a copy of the weights
_NOT_A_COPY = {"parameter", "get-tuple-element", "bitcast", "tuple", "reshape", "constant"}


@dataclass(frozen=True)
class LayerWeightCopies:
    # (op, one layer's weight shape) -> count, a leading 1 dropped: buffers written outside fusions,
    # and values inside fused computations
    top_level: Counter
    in_fusions: Counter

    @property
    def num_copies(self) -> int:
        return sum(self.top_level.values())


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if name is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("{")[0]:
                name = m.group(2)
                comps[name] = []
            continue
        if line.strip() == "}":
            name = None
        else:
            comps[name].append(line)
    return comps


def layer_weight_copies(hlo_text: str, layer_shapes: set[tuple[int, ...]]) -> LayerWeightCopies:
    """The instructions of `hlo_text` whose result has one layer's weight shape (with or without a
    leading 1), other than parameters and views, split by whether a fusion contains them. Vectors
    are left out: a hidden-sized vector is also every one-token activation."""
    layer_shapes = {s for s in layer_shapes if len(s) > 1}
    wanted = layer_shapes | {(1, *s) for s in layer_shapes}
    comps = _computations(hlo_text)
    fused = {m.group(1) for lines in comps.values() for line in lines for m in [_FUSION_CALLS.search(line)] if m}
    top, inner = Counter(), Counter()
    for name, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(3) in _NOT_A_COPY:
                continue
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            if shape in wanted:
                layer_shape = shape if shape in layer_shapes else shape[1:]
                (inner if name in fused else top)[(m.group(3), layer_shape)] += 1
    return LayerWeightCopies(top, inner)


def layer_shapes_of(stacked_layers) -> set[tuple[int, ...]]:
    """One layer's weight shapes, from weights stacked on [L]."""
    import jax

    return {tuple(leaf.shape[1:]) for leaf in jax.tree.leaves(stacked_layers)}
