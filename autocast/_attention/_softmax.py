"""The anchor: a softmax over one axis, in either of JAX's forms (after inlining, both read
`reduce_max -> [max(-inf, .)] -> broadcast -> [stop_gradient] -> sub -> exp -> reduce_sum ->
broadcast -> div`; `jax_softmax_custom_jvp` wraps the same body in a `custom_jvp`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _walk
from . import _vocab
from ._graph import Atom, Graph, Node


@dataclass(frozen=True)
class Softmax:
    """A softmax of `x` over its `axis`, giving `p`; `nodes`: its node indices."""

    x: int
    p: int
    axis: int
    nodes: frozenset[int]
    top: int  # the top-level equation of its `exp`
    form: str  # "inline", or the label of the equation holding it: "custom_jvp(_softmax)", ...


def find_softmaxes(g: Graph) -> list[Softmax]:
    """Every softmax of `g` (anchored on its `exp`)."""
    out = []
    for n, node in enumerate(g.nodes):
        if node.name == "exp" and not node.opaque:
            sm = _softmax_at(g, n)
            if sm is not None:
                out.append(sm)
    return out


def _reduced_from(g: Graph, atom: Atom, reducer: str, nodes: set[int]) -> tuple[int, int] | None:
    """If `atom` is `reducer` of some `x` over one axis, restored (peeling `_vocab.RESTORE`
    and `max` with a `-inf` constant): `(x, axis)`."""
    while True:
        node = g.node_of(atom)
        if node is None:
            return None
        nodes.add(g.producer[node.outs[0]])
        if node.name in _vocab.RESTORE:
            atom = node.ins[0]
        elif node.name == "max" and reducer == "reduce_max":
            consts = [a for a in node.ins if g.foldable(a)]
            if len(consts) != 1 or not np.all(np.isneginf(g.value(consts[0]).astype(np.float32))):
                return None
            atom = next(a for a in node.ins if not g.is_const(a))
        elif node.name == reducer:
            axes = tuple(node.params["axes"])
            x = node.ins[0]
            if len(axes) != 1 or not isinstance(x, int):
                return None
            return x, int(axes[0])
        else:
            return None


def _transposes(g: Graph, x: int, z: int) -> tuple[int, ...] | None:
    """`perm` with `x == transpose(z, perm)` through a chain of transposes (the
    identity for `x == z`), else None."""
    perm = tuple(range(len(g.shape(x))))
    cur: Atom = x
    while cur != z:
        node = g.node_of(cur)
        if node is None or node.name != "transpose":
            return None
        p = node.params["permutation"]
        perm = tuple(p[j] for j in perm)
        cur = node.ins[0]
    return perm


def _restores(g: Graph, reduced: Atom, x: int, axis: int) -> bool:
    shape, rshape = g.shape(x), g.shape(reduced)
    if len(rshape) != len(shape):
        return False
    return all(r == s or (i == axis and r == 1) for i, (r, s) in enumerate(zip(rshape, shape)))


def _softmax_at(g: Graph, n_exp: int) -> Softmax | None:
    exp = g.nodes[n_exp]
    sub = g.node_of(exp.ins[0])
    if sub is None or sub.name != "sub" or not isinstance(sub.ins[0], int):
        return None
    nodes = {n_exp, g.producer[sub.outs[0]]}
    found = _reduced_from(g, sub.ins[1], "reduce_max", nodes)
    x = sub.ins[0]
    perm = None if found is None else _transposes(g, x, found[0])
    if found is None or perm is None:
        return None
    axis = perm.index(found[1])  # the row maximum of x, maybe taken before a transpose
    if not _restores(g, sub.ins[1], x, axis):
        return None
    e = exp.outs[0]
    readers = [g.nodes[r] for r in g.readers.get(e, ())]
    divs = [r for r in readers if r.name == "div" and r.ins[0] == e]
    sums = [r for r in readers if r.name == "reduce_sum"]
    if len(readers) != 2 or len(divs) != 1 or len(sums) != 1 or e in g.outside:
        return None
    div: Node = divs[0]
    total = _reduced_from(g, div.ins[1], "reduce_sum", nodes)
    if total is None or total != (e, axis) or not _restores(g, div.ins[1], x, axis):
        return None
    nodes.add(g.producer[div.outs[0]])
    top = g.jaxpr.eqns[exp.top]
    form = "inline" if top.primitive.name == "exp" else _walk.label(top)
    return Softmax(x, div.outs[0], axis, frozenset(nodes), exp.top, form)
