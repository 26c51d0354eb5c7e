"""The vocabulary of the chunked head's matmuls, padded to a multiple of `MULTIPLE`.

GPT-2's vocabulary, 50,257, is odd. The backward pass of `x @ W.T` contracts it (the hidden
states' gradient, `dlogits @ W`), and GEMM kernels want an aligned contracted size: XLA:GPU
pads both operands to 50,272 (its split-K) *in every chunk*, a copy of the weight and one of
the chunk's logits cotangent (measured on the deviceless H100 target: 74 + 196 MiB live at
the step's peak, 4 chunks). The rewrite therefore passes the loop the weight padded once with
zero rows (columns of `W.T`) up to the next multiple of `MULTIPLE` (50,304; GPT-2 trainers
pad it so by hand for speed) where that adds at most `GROWTH` to the matmuls, computes each chunk's logits on it and slices them back to the
vocabulary before the user's equations read them.

Exact: a logit of the vocabulary is the same dot product; the padded logits are read by
nothing, so their cotangent is zero, and the zero rows add zero products to the hidden
states' gradient; the weight's gradient is the padded gradient's slice. Applied only where
the weight is an input of the span read by the head's matmul alone (directly or through one
transpose), the matmul having one vocabulary axis on that side.

Not where a TPU compiles the program (`_compat.tpu_compiler`): XLA:TPU lays a vocabulary out
in 128-lane tiles whatever its size, and there the slice of each chunk's logits and the pad
of their cotangent keep the cotangent out of the two matmuls that read it (it is written to
memory beside the logits instead of computed inside each): GPT-2 small's v5e step, with the
logits made flat (`_regroup`), 2,732 MiB of temp padded against 2,538 not (deviceless,
2026-11-28; benchmarks/results/tpu_modeled/findings.md, fifth pass). The choice is made when
the program is traced: a machine with libtpu installed traces for its TPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from .. import _compat
from .._attention._graph import Node

MULTIPLE = 128
"""The vocabulary is padded to a multiple of this (GEMM tiles on GPUs, the lane width on TPUs)."""

GROWTH = 1 / 32
"""The most the padding may add to the head's matmuls (a fraction of the vocabulary): 50,257 ->
50,304 adds 0.09 %, 1,000 -> 1,024 2.4 %; 200 -> 256 (28 %) is left to XLA's own alignment."""


@dataclasses.dataclass(frozen=True)
class Pad:
    """Where the vocabulary is padded: `input` (the index in the plan's inputs of the
    weight), its vocabulary `axis`, the vocabulary `size` and the `padded` size; `out_axis`,
    the vocabulary axis of the head's result."""

    input: int
    axis: int
    size: int
    padded: int
    out_axis: int


def find(
    nodes: Sequence[Node], head: int, axes: Mapping[int, Any], inputs: Sequence[int], shape: Callable[[int], Any]
) -> Pad | None:
    """How the vocabulary of a head is padded, or None (already a multiple, padding it would
    add more than `GROWTH`, the weight is not an input read by the head alone, or a TPU
    compiles the program).

    Args:
        nodes: The span's equations; `head`, the index of its matmul among them.
        axes: The chunked values' token axes (the weight is not one of them).
        inputs: The ids the span reads from outside, in order.
        shape: A value id -> its shape.
    """
    if _compat.tpu_compiler():
        return None
    node = nodes[head]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    side = next((j for j, a in enumerate(node.ins) if isinstance(a, int) and a not in axes), None)
    lhs = node.ins[0]
    if side is None or not isinstance(lhs, int):
        return None
    source = node.ins[side]
    assert isinstance(source, int)
    contracted, batch = (lc, lb) if side == 0 else (rc, rb)
    free = [d for d in range(len(shape(source))) if d not in contracted and d not in batch]
    if len(free) != 1:
        return None
    axis = free[0]
    producer = next((n for n in nodes if source in n.outs), None)
    if producer is not None:  # one transpose between the weight and the matmul
        before = producer.ins[0] if producer.ins else None
        if producer.name != "transpose" or _readers(nodes, source) != 1 or not isinstance(before, int):
            return None
        axis, source = producer.params["permutation"][axis], before
    if source not in inputs or _readers(nodes, source) != 1:
        return None
    size = shape(source)[axis]
    padded = -(-size // MULTIPLE) * MULTIPLE
    if padded == size or padded - size > GROWTH * size:
        return None
    nb, lfree = len(lb), len(shape(lhs)) - len(lc) - len(lb)
    return Pad(list(inputs).index(source), axis, size, padded, nb if side == 0 else nb + lfree)


def _readers(nodes: Sequence[Node], value: int) -> int:
    return sum(1 for n in nodes for a in n.ins if a == value)


def weight(x: Any, pad: Pad) -> Any:
    """The weight with zero rows up to the padded vocabulary."""
    config = [(0, 0, 0)] * x.ndim
    config[pad.axis] = (0, pad.padded - pad.size, 0)
    return lax.pad(x, lax.full((), 0, x.dtype), config)


def logits(y: Any, pad: Pad) -> Any:
    """The head's result on the padded weight, sliced back to the vocabulary."""
    return lax.slice_in_dim(y, 0, pad.size, axis=pad.out_axis)
