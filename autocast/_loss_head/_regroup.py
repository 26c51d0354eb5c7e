"""The head's matmul makes its result in the shape the loss reshapes it to.

A language model's loss usually flattens the logits before the cross-entropy:
`logits.reshape(-1, vocab)` of `[batch, seq, vocab]` (nanoGPT, the benchmark models, most
training loops). In a chunk that is `[2, 1024, 50257] -> [2048, 50257]`, and on XLA:TPU a
relayout: the two minor dimensions of the 3-D value and of the 2-D one are tiled
differently, so the reshape (and its transpose, the cotangent's) is a copy of the chunk's
logits, and the cotangent is then kept in memory for the two matmuls of the backward pass
instead of being computed inside each (deviceless v5e, a 4-chunk head at GPT-2 small's
shapes, 2026-11-28: 396 against 197 MiB of temp, 2.38 against 1.54 GB accessed per chunk;
`benchmarks/results/tpu_modeled/findings.md`, fifth pass).

The rewrite reshapes the narrow operand instead: the hidden states' token axes are merged
as the loss merges the logits' (`[2, 1024, 768] -> [2048, 768]`, a view), the matmul makes
`[2048, 50257]`, and the loss's reshape reads it as it is. Exact: every logit is the same
dot product of the same row and column, and the hidden states' gradient comes back in their
shape through the reshape's transpose. Applied where the reshape is the head's only reader,
merges or splits only the hidden states' leading (free) axes and keeps the vocabulary axes
last, and the matmul has no batch dimensions and contracts the hidden states' trailing axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax import lax

from .. import _compat
from .._attention._graph import Node
from . import _pad


def find(nodes: Sequence[Node], head: int, axes: Mapping[int, Any], outputs: Sequence[int]) -> int | None:
    """The index in `nodes` of the reshape whose token axes the head's matmul can make
    merged (`bind` checks the shapes at chunk size), or None.

    Args:
        nodes: The span's equations; `head`, the index of its matmul among them.
        axes: The chunked values' token axes (the hidden states are one, the weight not).
        outputs: The ids the span returns (the head's result must not be one).
    """
    node = nodes[head]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.ins[0], node.ins[1]
    if lb or rb or not isinstance(lhs, int) or not isinstance(axes.get(lhs), int):
        return None
    if isinstance(rhs, int) and isinstance(axes.get(rhs), int):
        return None
    out = node.outs[0]
    if out in outputs:
        return None
    readers = [j for j, n in enumerate(nodes) if out in n.ins]
    if len(readers) != 1:
        return None
    reader = nodes[readers[0]]
    if reader.name != "reshape" or reader.params.get("dimensions") is not None or reader.ins[0] != out:
        return None
    return readers[0]


def bind(
    node: Node, ins: Sequence[Any], params: Mapping[str, Any], new_sizes: Sequence[int], pad: _pad.Pad | None
) -> Any:
    """The head's result made in the shape `new_sizes` (the reshape's, at chunk size), the
    hidden states `ins[0]` reshaped first; or None where the reshape does not merely regroup
    their leading axes (the matmul then runs as written).

    `pad`: the weight's vocabulary padding; the result is sliced back to the vocabulary. A
    matmul with an explicit `out_sharding` (JAX's explicit sharding mode) runs as written."""
    lhs, rhs = ins
    (lc, rc), _ = params["dimension_numbers"]
    free = lhs.ndim - len(lc)
    if sorted(lc) != list(range(free, lhs.ndim)) or params.get("out_sharding") is not None:
        return None  # (an explicit output sharding names the result's axes as written)
    vocab = [d for i, d in enumerate(rhs.shape) if i not in rc]
    if pad is not None:
        vocab[pad.out_axis - free] = pad.size
    lead = tuple(new_sizes[: len(new_sizes) - len(vocab)])
    if list(new_sizes[len(lead) :]) != vocab or math.prod(lead) != math.prod(lhs.shape[:free]) or not lead:
        return None
    merged = lax.reshape(lhs, (*lead, *lhs.shape[free:]))
    contract = tuple(len(lead) + d - free for d in lc)
    (out,) = _compat.bind(node.prim, [merged, rhs], {**params, "dimension_numbers": ((contract, rc), ((), ()))})
    if pad is not None:
        out = _pad.logits(out, dataclasses.replace(pad, out_axis=pad.out_axis - free + len(lead)))
    return out
