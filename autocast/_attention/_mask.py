"""Mask and bias classification, and what a fully masked row gives.

The masks of a span are every `select_n` on the scores (a `where`) and every additive bias
that is a mask: a constant one made only of 0 and large negative numbers, or a traced one
that provably takes two values, 0 and one large negative number, chosen by a boolean
(`select_n(pred, c, 0)`, `where(m, 0, c)`, `convert(m) * c`, `(1 - convert(m)) * c`: Flax's and
Hugging Face's padding biases). A bias that is a sum (a learned position bias plus a mask
bias, as T5 builds it) is split into its terms. Each mask's boolean is split into conjuncts
through `and`, `not`, `or` under negation, layout equations and boolean converts (Flax's
`combine_masks` gives `ne(convert(and(...)), 0)`). Each conjunct is then:

- **constant** (it depends on no input of the jaxpr): evaluated at trace time and ANDed
  into one constant mask, which becomes `is_causal` (exactly `tril` with T == S), a
  left window (`is_causal` + `local_window_size=(w, 0)`), nothing (all true), or a
  constant `mask=`;
- **a length**: `iota < n` with the iota along the keys (`key_value_seq_lengths`) or the
  queries (`query_seq_lengths`, used only when the original also zeroes those output
  rows), `n` traced, integer and constant along every axis but the batch axes;
- **any other traced boolean**: `mask=`, broadcast to the full `T x S`.

Other biases (learned, or of unknown provenance) go to `bias=`.

**Fully masked rows.** A masked key's value in the original is the fill of the last `where`
that masks it, else the sum of the mask biases that mask it (the score vanishes in it when
the value absorbs it: `_scores.ABSORBED`), carried through the chain's later scaling and
converts (`_scores.Scores.ops`, replayed here for every combination of masks). Where a row
may have every key masked, the original's softmax there is uniform over the keys of the
largest masked value, NaN if that is `-inf`. The call reproduces it when all masked values
are one number (the mean of the values, or NaN for `-inf`); different values (a `-inf` fill
beside a `finfo.min` bias), or a masked value that depends on the scores (an additive
`-1e9`), leave the span alone. A learned bias beside kernel-side masks could itself mask a
row completely (it may carry `finfo.min`): then the masks are folded into the bias (their
fill where they mask, exact since the fill absorbs the scores), and the kernel reads one
bias and no mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _layout, _vocab
from ._graph import Atom, Graph
from ._match import Layout, Mask, MaskKind, Side
from ._scores import LARGE_NEGATIVE, Bias, Rejected, Scores, absorbs, uniform

_PEEL = _vocab.LAYOUT
_MAX_PATTERNS = 4096


def peel_layout(g: Graph, atom: Atom, amap: _layout.AxisMap) -> tuple[Atom, _layout.AxisMap]:
    """`atom` traced back through layout equations, with its axis map."""
    while (node := g.node_of(atom)) is not None and node.name in _PEEL:
        src = node.ins[0]
        if node.name == "broadcast_in_dim":
            amap = _layout.through_broadcast(amap, node.params["broadcast_dimensions"])
        elif node.name == "transpose":
            amap = _layout.untransposed(amap, node.params["permutation"])
        else:
            back = _layout.regrouped(g.shape(atom), g.shape(src), amap)
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
class Term:
    """One term of an additive bias (`Scores.biases[index]`), in the order of the sum:
    a mask term adds one of `values` (the bias's dtype, sign included) where it masks,
    0 elsewhere; a learned term adds an unknown value everywhere."""

    index: int
    values: tuple[Any, ...] = ()
    learned: bool = False


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
    terms: list[Term] = field(default_factory=list)
    dominant_bias: bool = False  # a learned bias that may mask a row on its own
    sides: list[tuple[int, int, float]] = field(default_factory=list)  # (bias, position in biases, sign)
    ops: list[tuple[Any, ...]] = field(default_factory=list)


def classify(g: Graph, scores: Scores, layout: Layout) -> Parts:
    """Split the masks and biases of `scores`.

    Raises:
        Rejected: A mask or bias the call cannot reproduce (the message says which).
    """
    rank = len(layout.lout_shape)
    parts = Parts(ops=list(scores.ops))
    terms = [t for index, b in enumerate(scores.biases) for t in _bias_terms(g, index, b, rank)]
    # A learned bias that may mask a row on its own (it may hold finfo.min, or -inf) makes
    # every bias term a bias: the kernel then adds them as the original does.
    parts.dominant_bias = any(t.dominant for t in terms)
    for t in terms:
        _add_term(g, t, not parts.dominant_bias, layout, parts)
    for w in scores.wheres:
        parts.fills.append(float(w.fill))
        _leaves(g, w.pred, w.amap, w.keep, layout, parts)
    return parts


def _leaves(g: Graph, pred: Atom, amap: _layout.AxisMap, keep: bool, layout: Layout, parts: Parts) -> None:
    """The conjuncts of a mask's boolean (keys kept where `pred == keep`) into `parts`."""
    rank = len(layout.lout_shape)
    for atom, cmap, positive in _conjuncts(g, pred, amap, keep):
        if g.foldable(atom):
            val = np.asarray(g.value(atom), bool)
            _and_const(parts, _layout.to_scores(val if positive else ~val, cmap, rank))
            continue
        found = length(g, atom, cmap, positive, layout)
        if found is not None and found.axis == layout.s and parts.kv_len is None:
            parts.kv_len = found
        elif found is not None and found.axis == layout.t and parts.q_len is None:
            parts.q_len = found
        else:
            parts.masks.append(Side(atom, cmap, 1.0 if positive else -1.0))  # type: ignore[arg-type]


def _and_const(parts: Parts, val: np.ndarray) -> None:
    parts.const_mask = val if parts.const_mask is None else np.logical_and(parts.const_mask, val)


def _terms(g: Graph, atom: Atom, amap: _layout.AxisMap, sign: float) -> list[tuple[Atom, _layout.AxisMap, float]]:
    """A bias as the terms of its sum, in order (through layout equations, `add`, `sub`)."""
    root, rmap = peel_layout(g, atom, amap)
    node = g.node_of(root)
    if node is None or node.name not in _vocab.SUMS or g.foldable(root):
        return [(atom, amap, sign)]
    a, b = node.ins
    second = -sign if node.name == "sub" else sign
    return [
        *_terms(g, a, _layout.operand(g.shape(a), rmap), sign),
        *_terms(g, b, _layout.operand(g.shape(b), rmap), second),
    ]


@dataclass
class _Term:
    """One term of a bias as `_bias_terms` finds it: a constant additive mask (`const`:
    its values on the scores, scaled; `raw`: as written, signed), a traced mask (`pred`
    kept where it equals `keep`; `added` where it masks), or learned (`dominant`: it may
    mask a row on its own)."""

    index: int
    atom: Atom
    amap: _layout.AxisMap
    coef: float
    sign: float = 1.0
    const: np.ndarray | None = None
    raw: np.ndarray | None = None
    pred: tuple[Atom, _layout.AxisMap, bool] | None = None
    added: Any = None
    dominant: bool = False


def _bias_terms(g: Graph, index: int, b: Bias, rank: int) -> list[_Term]:
    out = []
    for atom, amap, sign in _terms(g, b.atom, b.amap, 1.0):
        term = _Term(index, atom, amap, b.coef * sign, sign)
        root, rmap = peel_layout(g, atom, amap)
        dtype = np.dtype(g.aval(root).dtype)
        if g.foldable(root):
            raw = np.asarray(g.value(root))
            with np.errstate(all="ignore"):
                term.const = _layout.to_scores(raw.astype(np.float32) * np.float32(term.coef), rmap, rank)
            if np.all(term.const == 0):
                continue
            if np.all((term.const == 0) | (term.const <= LARGE_NEGATIVE)):
                term.raw = (raw * np.asarray(sign, raw.dtype)).astype(raw.dtype)
            else:
                term.dominant = bool(np.min(term.const) <= LARGE_NEGATIVE / 2)
            out.append(term)
            continue
        two = _two_valued(g, root, rmap)
        if two is not None:
            pred, pmap, if_true, if_false = two
            zero, other = (if_true, if_false) if if_true == 0 else (if_false, if_true)
            added = np.asarray(other * np.asarray(sign, dtype)).astype(dtype)
            if zero == 0 and float(other) * term.coef <= LARGE_NEGATIVE and absorbs(added, dtype):
                term.pred, term.added = (pred, pmap, bool(if_true == 0)), added
        term.dominant = term.pred is None
        out.append(term)
    return out


def _add_term(g: Graph, t: _Term, as_mask: bool, layout: Layout, parts: Parts) -> None:
    """A bias term into `parts`: a mask (its keep, and the values it adds where it masks,
    for the fully masked rows), or a bias the kernel adds."""
    if t.const is not None and t.raw is not None and as_mask:
        parts.additive = True
        _and_const(parts, t.const == 0)
        parts.terms.append(Term(t.index, tuple(np.unique(t.raw[t.raw != 0]))))
    elif t.const is not None:
        parts.const_bias = t.const if parts.const_bias is None else parts.const_bias + t.const
        parts.terms.append(Term(t.index, learned=True))
    elif t.pred is not None and as_mask:
        parts.terms.append(Term(t.index, (t.added,)))
        _leaves(g, *t.pred, layout, parts)
    else:
        parts.sides.append((t.index, len(parts.biases), t.sign))
        parts.biases.append(Side(t.atom, t.amap, t.coef))  # type: ignore[arg-type]
        parts.terms.append(Term(t.index, learned=True))


def bias_recipe(parts: Parts) -> tuple[tuple[Any, ...], ...]:
    """How the call sums the traced biases as the chain does (an overflow to `-inf`
    included): `("add", ((position in parts.biases, sign), ...), sign)` for each bias of
    the chain, `("mul" | "div", factor)` and `("convert", dtype)` in order."""
    out: list[tuple[Any, ...]] = []
    for op in parts.ops:
        if op[0] == "bias":
            sides = tuple((pos, sign) for index, pos, sign in parts.sides if index == op[1])
            if sides:
                out.append(("add", sides, op[2]))
        elif op[0] in ("mul", "div", "convert") and out:
            out.append(op)
    return tuple(out)


_ARITHMETIC = {"mul": np.multiply, "div": np.divide, "add": np.add, "sub": np.subtract}
"""A two-valued value stays two-valued through these, with a constant operand."""


def _two_valued(g: Graph, atom: Atom, amap: _layout.AxisMap) -> tuple[Atom, _layout.AxisMap, Any, Any] | None:
    """`atom` as `(pred, its axis map, value where pred, value where not)` when it provably
    takes one of two constant values chosen by a boolean (values in `atom`'s dtype)."""
    atom, amap = peel_layout(g, atom, amap)
    node = g.node_of(atom)
    if node is None:
        return None
    dtype = np.dtype(g.aval(atom).dtype)
    name = node.name
    if name == "convert_element_type":
        src = node.ins[0]
        if np.dtype(g.aval(src).dtype) == np.dtype(bool):
            return src, amap, np.asarray(1, dtype), np.asarray(0, dtype)
        inner = _two_valued(g, src, amap)
        return (
            None
            if inner is None
            else (inner[0], inner[1], np.asarray(inner[2]).astype(dtype), np.asarray(inner[3]).astype(dtype))
        )
    if name == "select_n" and len(node.ins) == 3 and np.dtype(g.aval(node.ins[0]).dtype) == np.dtype(bool):
        when_false, when_true = uniform(g, node.ins[1]), uniform(g, node.ins[2])
        if when_false is None or when_true is None:
            return None
        pred = node.ins[0]
        return pred, _layout.operand(g.shape(pred), amap), np.asarray(when_true, dtype), np.asarray(when_false, dtype)
    if name == "neg":
        inner = _two_valued(g, node.ins[0], amap)
        return None if inner is None else (*inner[:2], -inner[2], -inner[3])
    if name not in _ARITHMETIC or len(node.ins) != 2:
        return None
    consts = [uniform(g, x) for x in node.ins]
    if sum(c is not None for c in consts) != 1:
        return None
    i = 0 if consts[0] is None else 1
    inner = _two_valued(g, node.ins[i], _layout.operand(g.shape(node.ins[i]), amap))
    if inner is None:
        return None
    c = np.asarray(consts[1 - i], dtype)
    op = _ARITHMETIC[name]
    with np.errstate(all="ignore"):
        vals = [op(x, c) if i == 0 else op(c, x) for x in inner[2:]]
    return inner[0], inner[1], np.asarray(vals[0]).astype(dtype), np.asarray(vals[1]).astype(dtype)


_ZERO_TESTS = {("ne", 1): True, ("gt", 1): True, ("ne", 0): True, ("lt", 0): True, ("eq", 0): False, ("eq", 1): False}


def _as_bool(g: Graph, node: Any) -> tuple[Atom, bool] | None:
    """A comparison of a converted boolean with zero (`ne(convert(b), 0)`, `gt(.., 0)`,
    `eq(.., 0)`) as `(b, whether it equals b)`."""
    if len(node.ins) != 2:
        return None
    for zi in (0, 1):
        if (node.name, zi) not in _ZERO_TESTS or uniform(g, node.ins[zi]) != 0:
            continue
        x, _ = peel_layout(g, node.ins[1 - zi], (0,) * len(g.shape(node.ins[1 - zi])))
        conv = g.node_of(x)
        if conv is not None and conv.name == "convert_element_type":
            if np.dtype(g.aval(conv.ins[0]).dtype) == np.dtype(bool):
                return node.ins[1 - zi], _ZERO_TESTS[(node.name, zi)]
    return None


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
    if node.name in _vocab.COMPARISONS:
        found = _as_bool(g, node)
        if found is not None:
            x, same = found
            return _conjuncts(g, x, _layout.operand(g.shape(x), amap), positive if same else not positive)
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


def masked_values(parts: Parts) -> set[Any]:
    """Every value a masked key may have in the original at the softmax (None: one that
    depends on its score), over every combination of the masks that may mask it."""
    groups: list[tuple[str, int, tuple[Any, ...]]] = [("where", i, (True,)) for i in range(len(parts.fills))]
    groups += [("term", i, t.values) for i, t in enumerate(parts.terms) if not t.learned]
    options = [(None, *vals) for _, _, vals in groups]
    if np.prod([len(o) for o in options], dtype=np.float64) > _MAX_PATTERNS:
        raise Rejected(f"more than {_MAX_PATTERNS} combinations of masks to check for fully masked rows")
    out: set[Any] = set()
    for choice in itertools.product(*options):
        if all(c is None for c in choice):
            continue
        wheres = {i for (kind, i, _), c in zip(groups, choice) if kind == "where" and c is not None}
        terms = {i: c for (kind, i, _), c in zip(groups, choice) if kind == "term" and c is not None}
        out.add(_replay(parts, wheres, terms))
    return out


def _replay(parts: Parts, wheres: set[int], terms: dict[int, Any]) -> Any:
    """The value at the softmax of a key masked by `wheres` and the mask terms `terms`
    (term index -> the value it adds), as a float, or None if it depends on the score.
    Every constant carries the dtype the chain computed it in."""
    v: Any = None  # None: the score, not yet masked
    with np.errstate(all="ignore"):
        for op in parts.ops:
            kind = op[0]
            if kind == "where":
                v = op[2] if op[1] in wheres else v
            elif kind == "bias":
                total, exact = _bias_value(parts, op[1], terms)
                if not exact:  # a learned value is added: the masked value must absorb it
                    if v is not None and not absorbs(v, v.dtype):
                        return None
                elif total is not None and v is None:
                    if not absorbs(total, total.dtype):
                        return None
                    v = np.asarray(op[2] * total).astype(total.dtype)
                elif total is not None:
                    v = np.asarray(v + op[2] * total).astype(v.dtype)
            elif v is None:
                continue
            elif kind == "convert":
                v = np.asarray(v).astype(op[1])
            elif kind in ("mul", "div"):
                v = np.asarray(v * op[1] if kind == "mul" else v / op[1]).astype(op[1].dtype)
            elif kind == "shift":
                v = np.asarray(v + op[1] * op[2]).astype(op[2].dtype)
    return None if v is None else float(v)


def _bias_value(parts: Parts, index: int, terms: dict[int, Any]) -> tuple[Any, bool]:
    """What bias `index` adds at a key masked by the mask terms `terms`: `(value, True)`,
    `(None, True)` for exactly 0, `(None, False)` for a learned value (alone, or not
    absorbed by the mask terms beside it)."""
    total: Any = None
    learned = False
    for i, t in enumerate(parts.terms):
        if t.index != index:
            continue
        if t.learned:
            learned = True
            if total is not None and not absorbs(total, total.dtype):
                return None, False
        elif i in terms:
            c = np.asarray(terms[i])
            if total is None and learned and not absorbs(c, c.dtype):
                return None, False
            total = c if total is None else np.asarray(total + c).astype(c.dtype)
    if total is None:
        return None, not learned
    return total, True


def finish(parts: Parts, layout: Layout, q_routed: bool) -> tuple[Mask, np.ndarray | None, Any]:
    """The mask class, the constant mask the call passes, and the fill the masks are folded
    into the bias with (None: they are not).

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
    if kind & (MaskKind.MASK | MaskKind.KV_LENGTHS | MaskKind.Q_LENGTHS | MaskKind.CAUSAL):
        for fill in parts.fills:
            if not fill <= LARGE_NEGATIVE:
                raise Rejected(f"the masked scores are set to {fill:g}, not a large negative number")
    key_masks = kind & (MaskKind.MASK | MaskKind.KV_LENGTHS | MaskKind.CAUSAL)
    if parts.dominant_bias and key_masks:
        return _folded(parts, layout, kind, q_routed)
    if parts.biases or parts.const_bias is not None:
        kind |= MaskKind.BIAS
    traced = bool(parts.masks) or parts.kv_len is not None or (parts.q_len is not None and not q_routed)
    may_empty = traced or (parts.const_mask is not None and empty_rows(parts.const_mask, layout))
    empty_nan = False
    if may_empty:
        values = masked_values(parts)
        if None in values:
            raise Rejected(
                "an additive mask that does not absorb the scores, with query rows that may be fully masked "
                "(the original's result there depends on the scores)"
            )
        if len(values) > 1:
            shown = ", ".join(f"{v:g}" for v in sorted(values))
            raise Rejected(
                f"masks with different values where masked ({shown}) and query rows that may be fully masked "
                "(the original averages the values of the keys of the largest there)"
            )
        empty_nan = bool(values) and bool(np.isneginf(next(iter(values))))
    return Mask(kind, window, may_empty, empty_nan=empty_nan), const, None


def _folded(parts: Parts, layout: Layout, kind: MaskKind, q_routed: bool) -> tuple[Mask, np.ndarray | None, Any]:
    """A learned bias beside kernel-side masks: the masks folded into the bias."""
    values = masked_values(parts)
    if len(values) != 1 or None in values:
        shown = ", ".join("depends on the score" if v is None else f"{v:g}" for v in values)
        raise Rejected(
            f"a learned bias beside masks whose masked values ({shown}) are not one value that absorbs the scores "
            "(a row the bias masks completely would differ)"
        )
    fill = next(iter(values))
    if not absorbs(fill, np.float32):
        raise Rejected(
            f"a learned bias beside masks of fill {fill:g}, which does not absorb the scores "
            "(a row the bias masks completely would differ)"
        )
    kind = MaskKind.BIAS | (MaskKind.Q_LENGTHS if parts.q_len is not None and q_routed else MaskKind.NONE)
    return Mask(kind, None, False, folded=True), parts.const_mask, np.float32(fill)
