"""The span a match replaces: its output (after the value product), the check that nothing
outside reads its values, its side values with the scores' axes (`unmerged`), and the
program that computes them from its inputs."""

from __future__ import annotations

from typing import Any

import jax

from .. import _walk
from . import _layout, _mask
from ._graph import Atom, Graph, Lit
from ._match import Layout
from ._scores import Rejected, Scores
from ._softmax import Softmax


def ident(atom: Atom) -> int:
    """The id of an operand (a literal is not one the rewrite takes)."""
    if not isinstance(atom, int):
        raise Rejected("an operand of the products is a literal")
    return atom


def tail(
    g: Graph, out: int, amap: tuple[int, ...], q_len: _mask.Length | None, layout: Layout
) -> tuple[int, tuple[int, ...], list[int], bool]:
    """The span's output: the value product's, after the transposes only it reads, and
    after a `mul` zeroing the rows past the query lengths of `q_len` (`jax.nn`'s XLA
    path does that): `(output id, its axis map, the equations after the product, whether
    the rows are zeroed)`."""
    tail: list[int] = []
    cur = out
    while True:
        readers = g.readers.get(cur, [])
        if len(readers) != 1 or cur in g.outside:
            return cur, amap, tail, False
        node = g.nodes[readers[0]]
        if len(g.top_nodes[node.top]) != 1:
            return cur, amap, tail, False
        if node.name == "transpose":
            amap = _layout.transposed(amap, node.params["permutation"])
            tail.append(readers[0])
            cur = node.outs[0]
            continue
        if q_len is not None and node.name == "mul" and g.shape(node.outs[0]) == g.shape(cur):
            if zeroes(g, node.ins[1 - node.ins.index(cur)], amap, q_len, layout):
                return node.outs[0], amap, [*tail, readers[0]], True
        return cur, amap, tail, False


def zeroes(g: Graph, factor: Atom, amap: tuple[int, ...], q_len: _mask.Length, layout: Layout) -> bool:
    """Whether `factor` is `convert(iota_T < n)` for the query lengths `q_len`."""
    atom, famap = _mask.peel_layout(g, factor, _layout.operand(g.shape(factor), amap))
    fnode = g.node_of(atom)
    if fnode is None or fnode.name != "convert_element_type":
        return False
    atom, famap = _mask.peel_layout(g, fnode.ins[0], famap)
    if any(m == _layout.HV and d != 1 for m, d in zip(famap, g.shape(atom))):
        return False
    famap = tuple(-1 if m == _layout.HV else m for m in famap)
    found = _mask.length(g, atom, famap, True, layout)
    return found is not None and found.axis == layout.t and found.side == q_len.side


def unmerged(g: Graph, atom: Atom, amap: _layout.AxisMap, merges: _layout.Merges) -> tuple[Atom, _layout.AxisMap]:
    """A side value `atom` read where axes of the scores are merged (`amap` holds merged
    entries) as a value whose map names score axes only: a merged axis of size 1 is one the
    value lacks; a constant is split into the merged parts (a literal of its value); a
    traced value is followed back through `broadcast_in_dim` and `transpose` to where it
    does not vary along the merged axis.

    Raises:
        Rejected: A traced value varies along a merged axis (a value per merged head).
    """
    amap = tuple(-1 if merges.of(m) is not None and d == 1 else m for m, d in zip(amap, g.shape(atom)))
    if not _layout.merged(amap):
        return atom, amap
    if g.foldable(atom):
        val, amap = _layout.split_merged(g.value(atom), amap, merges)
        return Lit(val, jax.ShapeDtypeStruct(val.shape, val.dtype)), amap
    node = g.node_of(atom)
    if node is not None and node.name == "broadcast_in_dim":
        return unmerged(g, node.ins[0], _layout.through_broadcast(amap, node.params["broadcast_dimensions"]), merges)
    if node is not None and node.name == "transpose":
        return unmerged(g, node.ins[0], _layout.untransposed(amap, node.params["permutation"]), merges)
    raise Rejected(
        "a traced mask, bias or factor varies along axes of the scores a reshape merged (one per merged head)"
    )


def unmerge_sides(g: Graph, scores: Scores) -> None:
    """Every bias and mask of `scores` with the scores' own axes (`unmerged`), in place."""
    if not scores.merges.parts:
        return
    for b in scores.biases:
        b.atom, b.amap = unmerged(g, b.atom, b.amap, scores.merges)
    for w in scores.wheres:
        w.pred, w.amap = unmerged(g, w.pred, w.amap, scores.merges)


def check(g: Graph, tops: set[int], out: int, sm: Softmax) -> None:
    """Every value the equations `tops` compute is read only among them, but `out`."""
    for t in sorted(tops):
        for i in g.top_outs[t]:
            if i < 0 or i == out:
                continue
            readers = sorted({g.nodes[r].top for r in g.readers.get(i, ())} - tops)
            if readers or i in g.outside:
                what = "probabilities" if t >= g.nodes[g.producer[sm.p]].top else "scores"
                by = f"by `{_walk.label(g.jaxpr.eqns[readers[0]])}`" if readers else "returned"
                raise Rejected(f"the {what} are also read outside the attention ({by})")


def program(g: Graph, roots: list[int], tops: set[int], core: set[int]) -> tuple[tuple[int, ...], list, dict]:
    """What the call evaluates: (input ids, nodes inside the span, constant values)."""
    inputs: list[int] = []
    consts: dict[int, Any] = {}
    picked: set[int] = set()
    operands = set(roots[:3])  # q, k and v are inputs even where constant
    stack = list(reversed(roots))
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        n = g.producer.get(i)
        if n is None or g.nodes[n].top not in tops:
            if i not in operands and (g.known(i) or g.foldable(i)):
                consts[i] = g.value(i)
            elif i in g.var_of_id:
                inputs.append(i)
            else:
                raise Rejected("an operand of the attention is computed where the rewrite cannot read it")
            continue
        if n in core:
            raise Rejected("a mask or bias depends on the scores")
        picked.add(n)
        stack.extend(a for a in g.nodes[n].ins if isinstance(a, int))
    return tuple(inputs), [g.nodes[n] for n in sorted(picked)], consts
