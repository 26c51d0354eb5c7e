"""Mask and bias classification.

The masks of a span (every `select_n` on the scores, and every constant additive bias
made only of 0 and large negative numbers) are split into conjuncts through `and`,
`not`, `or` under negation and layout equations. Each conjunct is then:

- **constant** (it depends on no input of the jaxpr): evaluated at trace time and ANDed
  into one constant mask, which becomes `is_causal` (exactly `tril` with T == S), a
  left window (`is_causal` + `local_window_size=(w, 0)`), nothing (all true), or a
  constant `mask=`;
- **a length**: `iota < n` with the iota along the keys (`key_value_seq_lengths`) or the
  queries (`query_seq_lengths`, used only when the original also zeroes those output
  rows), `n` traced, integer and constant along every axis but the batch axes;
- **any other traced boolean**: `mask=`, broadcast to the full `T x S`.

Traced additive biases (and constant ones that are not masks) go to `bias=`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _layout
from ._graph import Atom, Graph
from ._match import Layout, Mask, MaskKind, Side
from ._scores import LARGE_NEGATIVE, Bias, Rejected, Scores

_PEEL = frozenset({"broadcast_in_dim", "transpose", "reshape", "squeeze", "expand_dims"})


def peel_layout(g: Graph, atom: Atom, amap: _layout.AxisMap) -> tuple[Atom, _layout.AxisMap]:
    """`atom` traced back through layout equations, with its axis map."""
    while (node := g.node_of(atom)) is not None and node.name in _PEEL:
        src = node.ins[0]
        if node.name == "broadcast_in_dim":
            amap = _layout.through_broadcast(amap, node.params["broadcast_dimensions"])
        elif node.name == "transpose":
            amap = _layout.untransposed(amap, node.params["permutation"])
        else:
            back = _layout.reshaped(g.shape(atom), g.shape(src), amap)
            if back is None:
                break
            amap = back
        atom = src
    return atom, amap


@dataclass
class Length:
    """`iota < n` along the score axis `axis`: `n` (its root after layout
    equations) and its axis map (`side`), and the comparison itself as a mask (`leaf`)."""

    axis: int
    side: Side
    leaf: Side


@dataclass
class Parts:
    """The masks and biases of a span, classified (before the output is examined)."""

    const_mask: np.ndarray | None = None
    const_bias: np.ndarray | None = None
    masks: list[Side] = field(default_factory=list)
    biases: list[Side] = field(default_factory=list)
    kv_len: Length | None = None
    q_len: Length | None = None
    fills: list[float] = field(default_factory=list)
    additive: bool = False


def classify(g: Graph, scores: Scores, layout: Layout) -> Parts:
    """Split the masks and biases of `scores`.

    Raises:
        Rejected: A mask or bias the call cannot reproduce (the message says which).
    """
    rank = len(layout.lout_shape)
    parts = Parts()
    for b in scores.biases:
        _bias(g, b, rank, parts)
    for w in scores.wheres:
        parts.fills.append(float(w.fill))
        for atom, amap, positive in _conjuncts(g, w.pred, w.amap, w.keep):
            if g.foldable(atom):
                val = np.asarray(g.value(atom), bool)
                _and_const(parts, _layout.to_scores(val if positive else ~val, amap, rank))
                continue
            found = length(g, atom, amap, positive, layout)
            if found is not None and found.axis == layout.s and parts.kv_len is None:
                parts.kv_len = found
            elif found is not None and found.axis == layout.t and parts.q_len is None:
                parts.q_len = found
            else:
                parts.masks.append(Side(atom, amap, 1.0 if positive else -1.0))  # type: ignore[arg-type]
    return parts


def _and_const(parts: Parts, val: np.ndarray) -> None:
    parts.const_mask = val if parts.const_mask is None else np.logical_and(parts.const_mask, val)


def _bias(g: Graph, b: Bias, rank: int, parts: Parts) -> None:
    root, amap = peel_layout(g, b.atom, b.amap)
    if not g.foldable(root):
        parts.biases.append(Side(b.atom, b.amap, b.coef))  # type: ignore[arg-type]
        return
    with np.errstate(all="ignore"):
        val = _layout.to_scores(np.asarray(g.value(root), np.float32) * np.float32(b.coef), amap, rank)
    if np.all(val == 0):
        return
    if np.all((val == 0) | (val <= LARGE_NEGATIVE)):
        parts.additive = True
        _and_const(parts, val == 0)
        return
    parts.const_bias = val if parts.const_bias is None else parts.const_bias + val


def _conjuncts(g: Graph, atom: Atom, amap: _layout.AxisMap, positive: bool) -> list[tuple[Atom, _layout.AxisMap, bool]]:
    """`atom` (kept where it equals `positive`) as a conjunction of leaves."""
    atom, amap = peel_layout(g, atom, amap)
    node = g.node_of(atom)
    if node is None:
        return [(atom, amap, positive)]
    if node.name == "not":
        return _conjuncts(g, node.ins[0], amap, not positive)
    if node.name == "convert_element_type" and np.dtype(g.aval(node.ins[0]).dtype) == np.dtype(bool):
        return _conjuncts(g, node.ins[0], amap, positive)
    if (node.name == "and" and positive) or (node.name == "or" and not positive):
        return [c for a in node.ins for c in _conjuncts(g, a, _layout.operand(g.shape(a), amap), positive)]
    return [(atom, amap, positive)]


_KEEP_LESS = {("lt", True): (0, 1), ("gt", True): (1, 0), ("ge", False): (0, 1), ("le", False): (1, 0)}


def length(g: Graph, atom: Atom, amap: _layout.AxisMap, positive: bool, layout: Layout) -> Length | None:
    """`iota < n` along the queries or keys, `n` traced and varying only along the
    batch axes (heads excluded), as a `Length`."""
    node = g.node_of(atom)
    if node is None or (node.name, positive) not in _KEEP_LESS:
        return None
    i_iota, i_len = _KEEP_LESS[(node.name, positive)]
    iota, n = node.ins[i_iota], node.ins[i_len]
    if g.is_const(n) or not np.issubdtype(np.dtype(g.aval(n).dtype), np.integer):
        return None
    rank = len(layout.lout_shape)
    root, iamap = peel_layout(g, iota, _layout.operand(g.shape(iota), amap))
    if not g.foldable(root):
        return None
    val = _layout.to_scores(np.asarray(g.value(root)), iamap, rank)
    for axis in (layout.s, layout.t):
        size = layout.lout_shape[axis]
        if val.shape[axis] != size:
            continue
        shape = [1] * rank
        shape[axis] = size
        want = np.arange(size).reshape(shape)
        if np.array_equal(
            np.broadcast_to(val, np.broadcast_shapes(val.shape, want.shape)),
            np.broadcast_to(want, np.broadcast_shapes(val.shape, want.shape)),
        ):
            nroot, namap = peel_layout(g, n, _layout.operand(g.shape(n), amap))
            nshape = g.shape(nroot)
            if all(s == 1 or m in layout.batch for s, m in zip(nshape, namap)):
                return Length(axis, Side(nroot, namap), Side(atom, amap, 1.0 if positive else -1.0))  # type: ignore[arg-type]
            return None
    return None


def const_class(mask: np.ndarray, layout: Layout) -> tuple[MaskKind, int | None, np.ndarray | None]:
    """A constant mask (broadcastable to the scores) as `(kind, window, mask)`: `NONE`,
    `CAUSAL`, `CAUSAL | WINDOW` (with the window) or `MASK` (with the mask)."""
    if np.all(mask):
        return MaskKind.NONE, None, None
    t_size, s_size = layout.lout_shape[layout.t], layout.lout_shape[layout.s]
    others = tuple(a for a in range(mask.ndim) if a not in (layout.t, layout.s))
    every, some = np.all(mask, axis=others), np.any(mask, axis=others)
    if t_size == s_size and np.array_equal(every, some):  # the same for every batch and head
        m2 = np.broadcast_to(every if layout.t < layout.s else every.T, (t_size, s_size))
        rows, cols = np.indices((t_size, s_size))
        if np.array_equal(m2, cols <= rows):
            return MaskKind.CAUSAL, None, None
        window = t_size - 1 - int(np.argmax(m2[-1]))
        if m2[-1].any() and np.array_equal(m2, (cols <= rows) & (rows - cols <= window)):
            return MaskKind.CAUSAL | MaskKind.WINDOW, window, None
    return MaskKind.MASK, None, mask


def empty_rows(mask: np.ndarray, layout: Layout) -> bool:
    """Whether some query row of a constant mask keeps no key."""
    return bool(np.any(~np.any(mask, axis=layout.s)))


def finish(parts: Parts, layout: Layout, q_routed: bool) -> tuple[Mask, np.ndarray | None]:
    """The mask class, and the constant mask the call passes.

    Raises:
        Rejected: The original's result cannot be reproduced (the message says why).
    """
    kind = MaskKind.NONE
    window = None
    const = None
    if parts.const_mask is not None:
        kind, window, const = const_class(parts.const_mask, layout)
    if parts.masks:
        kind |= MaskKind.MASK
    if parts.kv_len is not None:
        kind |= MaskKind.KV_LENGTHS
    if parts.q_len is not None:
        kind |= MaskKind.Q_LENGTHS if q_routed else MaskKind.MASK
    if parts.biases or parts.const_bias is not None:
        kind |= MaskKind.BIAS
    traced = bool(parts.masks) or parts.kv_len is not None or (parts.q_len is not None and not q_routed)
    may_empty = traced or (parts.const_mask is not None and empty_rows(parts.const_mask, layout))
    if kind & (MaskKind.MASK | MaskKind.KV_LENGTHS | MaskKind.Q_LENGTHS | MaskKind.CAUSAL):
        for fill in parts.fills:
            if not fill <= LARGE_NEGATIVE:
                raise Rejected(f"the masked scores are set to {fill:g}, not a large negative number")
    if may_empty:
        if any(np.isneginf(f) for f in parts.fills):
            raise Rejected("a -inf fill with query rows that may be fully masked (the original gives NaN there)")
        if parts.additive:
            raise Rejected(
                "an additive mask with query rows that may be fully masked (the original's result there depends on the scores)"
            )
        if len(set(parts.fills)) > 1:
            raise Rejected("masks with different fill values and query rows that may be fully masked")
    return Mask(kind, window, may_empty), const
