"""From the softmax back to the `q . k` product: the equations on the scores, and what
they do to them.

`paths` finds the chains of equations that lead from a `dot_general` to the
softmax's input; `replay` walks one forward from the product and reduces it to
`where(keep, scale * scores + bias, fill)`: a concrete scale, additive biases, boolean
masks with their fill values, and the axis map of the softmax's input. Anything else on the
chain (a traced scale, softcapping, a bias added after a mask, a fill that is not a large
negative number, ...) ends the replay with the reason.

What may sit on the chain is one table, `RULES`: primitive name -> the rule that replays it
(or refuses it with the reason) and which of its operands may be the chain. The search
follows exactly the primitives the table names; a new operation on the scores is one entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _layout, _vocab
from ._graph import Atom, Graph, Node

_MAX_DEPTH = 24

LARGE_NEGATIVE = -1.0e4
"""A masked score at or below this gives `exp(masked - row max) == 0` exactly (float32
underflows below -104) for any scores within 9,000 of each other: the same assumption
`jax.nn.dot_product_attention` makes with its own fill."""

ABSORBED = 2.0**40
"""Scores (with any learned bias added to them) are assumed smaller than this in magnitude.
A masked value `c` absorbs them, `s + c == c` exactly, when a quarter of its unit in the last
place is at least this (round to nearest, with the smaller spacing just below a power of two):
`|c| >= 2**(40 + 2 + mantissa bits)`, float32 `2**65` (`finfo.min` and `jax.nn`'s
`-0.7 * finfo.max` are), bfloat16 `2**49`, never in float16; `-inf` absorbs every finite
score. An additive mask of such a value gives a masked key the same value whatever its score,
as a `where` fill does (`_mask` computes what a fully masked row then gives)."""


def absorbs(value: Any, dtype: Any) -> bool:
    """Whether `value` (of `dtype`) absorbs every score smaller than `ABSORBED`."""
    c = float(value)
    if np.isnan(c) or c > 0:
        return False
    return bool(np.isneginf(c) or abs(c) >= 2.0 ** (40 + 2 + np.finfo(dtype).nmant))


@dataclass(frozen=True)
class Step:
    """One equation on the chain and which of its operands is the chain."""

    node: int
    operand: int


@dataclass
class Bias:
    atom: Atom
    amap: _layout.AxisMap
    coef: float


@dataclass
class Where:
    """`select_n` on the scores: keep where `pred` is `keep` (else `fill`)."""

    pred: Atom
    amap: _layout.AxisMap
    keep: bool
    fill: Any  # NumPy scalar in the scores' dtype at the softmax (updated by later steps)


@dataclass
class Scores:
    """The chain reduced to `where(keep, scale * scores + sum(coef * bias), fill)`."""

    amap: _layout.AxisMap
    dtype: np.dtype
    scale: float = 1.0
    biases: list[Bias] = field(default_factory=list)
    wheres: list[Where] = field(default_factory=list)
    # What the chain does to a masked value, in order (`_mask` replays it): ("bias", index,
    # sign), ("where", index, fill), ("mul" | "div", factor), ("shift", sign, value), ("convert", dtype).
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    merges: _layout.Merges = field(default_factory=_layout.Merges)  # axes a reshape merged


class Rejected(Exception):
    """The chain does something the rewrite cannot reproduce (the message says what)."""


def uniform(g: Graph, atom: Atom) -> Any | None:
    """The value of a constant whose elements are all equal, as a NumPy scalar of its dtype
    (None if it is traced or not uniform)."""
    if not g.is_const(atom):
        return None
    root = atom
    while (node := g.node_of(root)) is not None and node.name in _vocab.LAYOUT:
        root = node.ins[0]
    if not g.foldable(root):
        return None
    val = np.asarray(g.value(root))
    if val.size == 0 or not np.all(val == val.reshape(-1)[0]):
        if not (val.size and np.all(np.isnan(val))):
            return None
    return val.reshape(-1)[0]


def _size1(g: Graph, atom: Atom) -> bool:
    return all(d == 1 for d in g.shape(atom))


def paths(g: Graph, x: int) -> Iterator[tuple[int, list[Step]]]:
    """Every `(dot_general node, steps from its output to x)`, the likeliest first."""
    yield from _search(g, x, [], 0)


def _search(g: Graph, atom: Atom, steps: list[Step], depth: int) -> Iterator[tuple[int, list[Step]]]:
    node = g.node_of(atom)
    if node is None or node.opaque or depth > _MAX_DEPTH:
        return
    n = g.producer[atom]  # type: ignore[index]
    if node.name == "dot_general":
        yield n, steps
        return
    rule = RULES.get(node.name)
    if rule is None:
        return
    for i in [0] if rule.unary else _chain_candidates(g, node, rule.first):
        yield from _search(g, node.ins[i], [Step(n, i), *steps], depth + 1)


def _chain_candidates(g: Graph, node: Node, first: int) -> list[int]:
    cands = [i for i in range(first, len(node.ins)) if not g.is_const(node.ins[i])]
    # the operand with the scores' shape first; a broadcast (a bias) after
    out = g.shape(node.outs[0])
    return sorted(cands, key=lambda i: g.shape(node.ins[i]) != out)


def replay(g: Graph, steps: list[Step], product: Node) -> Scores:
    """Walk `steps` forward from the product's output.

    Raises:
        Rejected: A step the rewrite cannot reproduce (the message says which).
    """
    out = product.outs[0]
    state = Scores(tuple(range(len(g.shape(out)))), np.dtype(g.aval(out).dtype))
    for step in steps:
        node = g.nodes[step.node]
        rule = RULES[node.name]
        if not rule.moves_axes and g.shape(node.ins[step.operand]) != g.shape(node.outs[0]):
            raise Rejected(f"`{node.name}` broadcasts the scores to {list(g.shape(node.outs[0]))}")
        rule.apply(g, node, step.operand, state)
    return state


def _rescale(state: Scores, factor: Any) -> None:
    state.scale *= float(factor)
    for b in state.biases:
        b.coef *= float(factor)
    with np.errstate(all="ignore"):
        for w in state.wheres:
            w.fill = (np.asarray(w.fill, state.dtype) * np.asarray(factor, state.dtype)).astype(state.dtype)


def _unchanged(g: Graph, node: Node, i: int, state: Scores) -> None:
    """A copy, or a rounding the kernel's own precision stands for."""


def _convert(g: Graph, node: Node, i: int, state: Scores) -> None:
    dtype = np.dtype(node.params["new_dtype"])
    if not np.issubdtype(dtype, np.floating) and dtype.name not in ("bfloat16", "float16"):
        raise Rejected(f"the scores are converted to {dtype.name}")
    with np.errstate(all="ignore"):
        for w in state.wheres:
            w.fill = np.asarray(w.fill).astype(dtype)
    state.dtype = dtype
    state.ops.append(("convert", dtype))


def _transpose(g: Graph, node: Node, i: int, state: Scores) -> None:
    state.amap = _layout.transposed(state.amap, node.params["permutation"])


def _regroup(g: Graph, node: Node, i: int, state: Scores) -> None:
    """A reshape that inserts or removes size-1 axes, or merges or splits axes
    (`_layout.regrouped`); a `broadcast_in_dim` only where it inserts size-1 axes."""
    shape_in, shape_out = g.shape(node.ins[i]), g.shape(node.outs[0])
    if node.name == "broadcast_in_dim" and not _layout.broadcast_inserts(
        shape_in, shape_out, node.params["broadcast_dimensions"]
    ):
        raise Rejected(f"`broadcast_in_dim` broadcasts the scores to {list(shape_out)}")
    amap = _layout.regrouped(shape_in, shape_out, state.amap, state.merges)
    if amap is None:
        raise Rejected(f"`{node.name}` reshapes the scores from {list(shape_in)} to {list(shape_out)}")
    state.amap = amap


def _scale(g: Graph, node: Node, i: int, state: Scores) -> None:
    """`mul` or `div` by a constant whose elements are all equal: the scale."""
    name, other = node.name, node.ins[1 - i]
    if name == "div" and i == 1:
        raise Rejected("the scores divide a value")
    val = uniform(g, other)
    if val is None:
        if not g.is_const(other) and _size1(g, other):
            raise Rejected("a traced scale: the kernel takes a concrete scale")
        raise Rejected(f"the scores are multiplied by a {'traced' if not g.is_const(other) else 'non-uniform'} tensor")
    factor = 1.0 / float(val) if name == "div" else float(val)
    if not np.isfinite(factor) or factor == 0.0:
        raise Rejected(f"the scale {factor} is not a finite nonzero number")
    _rescale(state, factor)
    state.ops.append((name, np.asarray(val).astype(state.dtype)))


def _add(g: Graph, node: Node, i: int, state: Scores) -> None:
    """`add`/`sub` of a uniform constant (a shift softmax ignores) or of a bias."""
    name, other = node.name, node.ins[1 - i]
    if name == "sub" and i == 1:
        raise Rejected("the scores are negated (subtracted from a value)")
    sign = -1.0 if name == "sub" else 1.0
    shift = uniform(g, other)
    if shift is not None:  # a constant shift: softmax is invariant to it
        with np.errstate(all="ignore"):
            for w in state.wheres:
                w.fill = (np.asarray(w.fill, state.dtype) + sign * np.asarray(shift, state.dtype)).astype(state.dtype)
        state.ops.append(("shift", sign, np.asarray(shift).astype(state.dtype)))
        return
    if state.wheres:
        raise Rejected("a bias is added after a mask")
    state.ops.append(("bias", len(state.biases), sign))
    state.biases.append(Bias(other, _layout.operand(g.shape(other), state.amap), sign))


def _select(g: Graph, node: Node, i: int, state: Scores) -> None:
    """`select_n(pred, ...)` against a uniform constant: a mask and its fill."""
    if len(node.ins) != 3:
        raise Rejected(f"`select_n` of {len(node.ins) - 1} cases on the scores")
    pred, fill_atom = node.ins[0], node.ins[3 - i]
    if np.dtype(g.aval(pred).dtype) != np.dtype(bool):
        raise Rejected("`select_n` on the scores with an integer selector")
    fill = uniform(g, fill_atom)
    if fill is None:
        raise Rejected("the scores are replaced by a traced or non-uniform value where masked")
    pamap = _layout.operand(g.shape(pred), state.amap)
    state.ops.append(("where", len(state.wheres), np.asarray(fill).astype(state.dtype)))
    state.wheres.append(Where(pred, pamap, keep=(i == 2), fill=np.asarray(fill).astype(state.dtype)))


def _refuse(reason: str) -> Callable[[Graph, Node, int, Scores], None]:
    """A rule for an operation the kernel cannot reproduce (`{name}` in `reason`: the primitive)."""

    def rule(g: Graph, node: Node, i: int, state: Scores) -> None:
        raise Rejected(reason.format(name=node.name))

    return rule


@dataclass(frozen=True)
class ScoresRule:
    """How the replay treats one primitive on the chain: `apply(g, node, operand, state)`
    (raises `Rejected` with the reason), whether only its first operand can be the chain
    (`unary`; else any non-constant operand from `first` on), and whether it may change
    the chain's shape (`moves_axes`: layout equations; every other rule keeps it)."""

    apply: Callable[[Graph, Node, int, Scores], None]
    unary: bool = True
    first: int = 0
    moves_axes: bool = False


RULES: dict[str, ScoresRule] = {
    "copy": ScoresRule(_unchanged),
    "reduce_precision": ScoresRule(_unchanged),
    "convert_element_type": ScoresRule(_convert),
    "transpose": ScoresRule(_transpose, moves_axes=True),
    "reshape": ScoresRule(_regroup, moves_axes=True),
    "squeeze": ScoresRule(_regroup, moves_axes=True),
    "broadcast_in_dim": ScoresRule(_regroup, moves_axes=True),
    "mul": ScoresRule(_scale, unary=False),
    "div": ScoresRule(_scale, unary=False),
    "add": ScoresRule(_add, unary=False),
    "add_any": ScoresRule(_add, unary=False),
    "sub": ScoresRule(_add, unary=False),
    "select_n": ScoresRule(_select, unary=False, first=1),
    "neg": ScoresRule(_refuse("the scores are negated")),
    "stop_gradient": ScoresRule(_refuse("the scores' gradient is stopped")),
    "tanh": ScoresRule(_refuse("softcapping (tanh on the scores)")),
    "max": ScoresRule(_refuse("the scores are clipped (`{name}`)"), unary=False),
    "min": ScoresRule(_refuse("the scores are clipped (`{name}`)"), unary=False),
    "clamp": ScoresRule(_refuse("the scores are clipped (`{name}`)"), unary=False, first=1),
}
"""What may sit on the scores between the `q . k` product and the softmax: the search
follows these primitives only, and the replay applies each one's rule."""
