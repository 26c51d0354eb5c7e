"""Operand roles, proved from `dot_general` dimension numbers and the transposes present.

The scores' axes are the `q . k` product's output axes: its batch axes (shared by q and
k), q's free axes (the queries `T`, and any other query-only axes: grouped-query heads
`G`), then k's free axis, which must be the softmax axis (the keys `S`); the one
contracted axis is the head dimension `H`. The `p . v` product must contract exactly
the keys, pair exactly the scores' batch axes with v's, and leave q's free axes and one
axis of v (`Hv`). No axis is ever identified by its position or its size.

On their way to the value product the probabilities may be split back where the scores
were merged (`_layout.regrouped`), and multiplied by *factors* that do not vary along the
keys (Hugging Face's head mask, `einsum("...hqk,h->...hqk", p, head_mask)` or
`p * head_mask[:, None, None]`): such a factor commutes with the value product, which
contracts only the keys, and the call multiplies its output by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp

from . import _layout, _mask, _span, _vocab
from ._graph import Atom, Graph, Node
from ._scores import Rejected, uniform

H = -3  # the contracted head dimension in an operand's axis map


@dataclass
class Product:
    """The `q . k` product: which operand is q, and each operand axis's score axis."""

    node: int
    q: Atom
    k: Atom
    q_map: tuple[int, ...]  # q axis -> score axis (H: contracted)
    k_map: tuple[int, ...]
    n_batch: int
    q_free: tuple[int, ...]
    s: int
    shape: tuple[int, ...]  # the scores' shape


def product(g: Graph, n: int, s: int) -> Product:
    """Roles of the `q . k` product `g.nodes[n]` whose score axis `s` the softmax
    normalises.

    Raises:
        Rejected: The product is not one whose roles can be proved (the message says why).
    """
    node = g.nodes[n]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if len(lc) != 1:
        raise Rejected(f"the scores contract {len(lc)} axes of q and k")
    maps = []
    free = []
    nb = len(lb)
    offset = nb
    for atom, contract, batch in ((node.ins[0], lc, lb), (node.ins[1], rc, rb)):
        rank = len(g.shape(atom))
        fr = [d for d in range(rank) if d not in contract and d not in batch]
        m = [0] * rank
        for i, d in enumerate(batch):
            m[d] = i
        for j, d in enumerate(fr):
            m[d] = offset + j
        m[contract[0]] = H
        offset += len(fr)
        maps.append(tuple(m))
        free.append(tuple(offset - len(fr) + j for j in range(len(fr))))
    if s < nb:
        raise Rejected("the softmax runs over a batch axis of the product")
    qi = 0 if s in free[1] else 1
    ki = 1 - qi
    if free[ki] != (s,):
        raise Rejected(f"the softmax axis is one of the query's axes, not the key axis ({len(free[ki])} key axes)")
    if not free[qi]:
        raise Rejected("the product has no query axis (a single query)")
    return Product(n, node.ins[qi], node.ins[ki], maps[qi], maps[ki], nb, free[qi], s, g.shape(node.outs[0]))


@dataclass
class ValueProduct:
    """The `p . v` product: v, its axis map and the output's axis map (score axes,
    `HV` for v's head dimension, `-1` for size-1 axes), and the factors on the
    probabilities before it (each a value and its axes as score axes)."""

    node: int
    v: Atom
    v_map: tuple[int, ...]
    out_amap: tuple[int, ...]
    steps: list[int] = field(default_factory=list)  # equations between p and it
    factors: list[tuple[Atom, _layout.AxisMap]] = field(default_factory=list)


def value_product(
    g: Graph, p: int, amap: _layout.AxisMap, prod: Product, merges: _layout.Merges | None = None
) -> ValueProduct:
    """Follow the probabilities `p` (axis map `amap`, its merged axes in `merges`) to the
    `p . v` product, through layout equations and factors that do not vary along the keys."""
    merges = _layout.Merges() if merges is None else merges
    steps: list[int] = []
    factors: list[tuple[Atom, _layout.AxisMap]] = []
    cur = p
    while True:
        readers = g.readers.get(cur, [])
        if len(readers) != 1 or cur in g.outside:
            raise Rejected("the probabilities are read more than once (an attention map returned or stored)")
        n = readers[0]
        node = g.nodes[n]
        if node.name == "dot_general" and not _scales(g, node, cur):
            break
        if node.name in ("mul", "dot_general"):
            atom, famap, amap = _factor(g, node, cur, amap, prod, merges)
            factors.append((atom, famap))
        elif node.name not in _vocab.FORWARD or (
            node.name == "broadcast_in_dim"
            and not _layout.broadcast_inserts(g.shape(cur), g.shape(node.outs[0]), node.params["broadcast_dimensions"])
        ):
            raise Rejected(dropout_or(g, node, f"`{node.name}` on the probabilities before the value product"))
        elif node.name == "transpose":
            amap = _layout.transposed(amap, node.params["permutation"])
        elif node.name in _vocab.LAYOUT:
            new = _layout.regrouped(g.shape(cur), g.shape(node.outs[0]), amap, merges)
            if new is None:
                raise Rejected(
                    f"`{node.name}` splits the probabilities' merged heads otherwise than the scores' reshape merged them"
                    if _layout.merged(amap)
                    else f"`{node.name}` reshapes the probabilities from {list(g.shape(cur))} to {list(g.shape(node.outs[0]))}"
                )
            amap = new
        steps.append(n)
        cur = node.outs[0]
    if _layout.merged(amap):
        raise Rejected("the probabilities reach the value product with axes a reshape merged (not split back)")
    pi = node.ins.index(cur)
    vi = 1 - pi
    (cl, cr), (bl, br) = node.params["dimension_numbers"]
    pc, vc = (cl, cr) if pi == 0 else (cr, cl)
    pb, vb = (bl, br) if pi == 0 else (br, bl)
    if len(pc) != 1 or amap[pc[0]] != prod.s:
        raise Rejected("the value product does not contract the softmax axis")
    pbatch = [amap[d] for d in pb]
    if sorted(pbatch) != list(range(prod.n_batch)):
        raise Rejected("the value product pairs other axes than the scores' batch axes")
    p_rank = len(g.shape(cur))
    pfree = [d for d in range(p_rank) if d not in pc and d not in pb]
    if sorted(m for d in pfree if (m := amap[d]) >= 0) != sorted(prod.q_free):
        raise Rejected("the value product does not keep the query axes")
    v = node.ins[vi]
    v_rank = len(g.shape(v))
    vfree = [d for d in range(v_rank) if d not in vc and d not in vb]
    if len(vfree) != 1:
        raise Rejected(f"the values have {len(vfree)} free axes (one head dimension expected)")
    v_map = [0] * v_rank
    for d, m in zip(vb, pbatch):
        v_map[d] = m
    v_map[vc[0]] = prod.s
    v_map[vfree[0]] = _layout.HV
    p_out = [amap[d] for d in pfree]
    out_amap = pbatch + (p_out + [_layout.HV] if pi == 0 else [_layout.HV] + p_out)
    return ValueProduct(n, v, tuple(v_map), tuple(out_amap), steps, factors)


def _scales(g: Graph, node: Node, cur: int) -> bool:
    """Whether the `dot_general` `node` multiplies `cur` elementwise by a value of batch
    axes only (`einsum("...hqk,h->...hqk", p, head_mask)`): no contraction, and every axis
    of the other operand is a batch axis."""
    (lc, rc), (lb, _) = node.params["dimension_numbers"]
    other = node.ins[1 - node.ins.index(cur)]
    return not lc and not rc and len(lb) == len(g.shape(other))


def _factor(
    g: Graph, node: Node, cur: int, amap: _layout.AxisMap, prod: Product, merges: _layout.Merges
) -> tuple[Atom, _layout.AxisMap, _layout.AxisMap]:
    """A factor on the probabilities `cur` (a `mul`, or a `dot_general` that `_scales`):
    `(its value, that value's axes as score axes, the probabilities' map after it)`.

    Raises:
        Rejected: Dropout, or a factor that varies along the keys.
    """
    if (reason := dropout_or(g, node, "")) != "":
        raise Rejected(reason)
    pi = node.ins.index(cur)
    other = node.ins[1 - pi]
    if node.name == "mul":
        famap, out = _layout.operand(g.shape(other), amap), amap
    else:
        (_, _), (lb, rb) = node.params["dimension_numbers"]
        pb, ob = (lb, rb) if pi == 0 else (rb, lb)
        fm = [-1] * len(g.shape(other))
        for d, e in zip(ob, pb):
            fm[d] = amap[e]
        famap = tuple(fm)
        out = tuple([amap[d] for d in pb] + [m for d, m in enumerate(amap) if d not in pb])
    atom, famap = _mask.peel_layout(g, other, famap)
    atom, famap = _span.unmerged(g, atom, famap, merges)
    if any(m == prod.s and d != 1 for m, d in zip(famap, g.shape(atom))):
        raise Rejected(
            "the probabilities are multiplied by a value that varies along the keys (a mask after the softmax)"
        )
    return atom, famap, out


def dropout_or(g: Graph, node: Node, reason: str) -> str:
    """`"dropout on the probabilities"` if random bits reach `node` or the few
    equations after it (a keep mask), else `reason`."""
    frontier, nodes = [node], []
    for _ in range(4):
        nodes += frontier
        frontier = [g.nodes[r] for n in frontier for o in n.outs if o >= 0 for r in g.readers.get(o, ())]
    stack = [a for n in nodes for a in n.ins if isinstance(a, int)]
    seen: set[int] = set()
    while stack and len(seen) < 400:
        i = stack.pop()
        n = g.node_of(i)
        if i in seen or n is None:
            continue
        seen.add(i)
        if n.name in _vocab.RANDOM:
            return "dropout on the probabilities (the kernel cannot reproduce its random mask)"
        stack.extend(a for a in n.ins if isinstance(a, int))
    return reason


@dataclass
class Peeled:
    """An operand traced back through single-reader layout and scale equations."""

    src: Atom
    axes: tuple[int, ...]  # src axis -> the operand's axis
    scale: float = 1.0
    nodes: list[int] = field(default_factory=list)
    repeat: tuple[int, int] | None = None  # (operand axis, times) of a repeated heads axis


def peel(g: Graph, atom: Atom, *, scale: bool, repeat: bool, taken: frozenset[int] = frozenset()) -> Peeled:
    """Trace `atom` back through `transpose`, float `convert_element_type`, constant
    scalar `mul`/`div` (`scale`) and a `jnp.repeat` of one axis (`repeat`):
    each a top-level equation whose result only the next one reads, and that no earlier
    span holds (`taken`)."""
    out = Peeled(atom, tuple(range(len(g.shape(atom)))))
    while isinstance(out.src, int) and g.n_readers(out.src) == 1:
        node = g.node_of(out.src)
        if node is None or len(g.top_nodes[node.top]) != 1 or node.top in taken:
            break
        n = g.producer[out.src]
        name = node.name
        if name == "transpose":
            out.axes = _layout.untransposed(out.axes, node.params["permutation"])
        elif name == "convert_element_type":
            if not jnp.issubdtype(g.aval(node.ins[0]).dtype, jnp.floating):
                break
        elif name in ("mul", "div") and scale:
            consts = [i for i, a in enumerate(node.ins) if uniform(g, a) is not None]
            if len(consts) != 1 or (name == "div" and consts[0] == 0):
                break
            val = float(uniform(g, node.ins[consts[0]]))  # type: ignore[arg-type]
            out.scale *= 1.0 / val if name == "div" else val
            out.nodes.append(n)
            out.src = node.ins[1 - consts[0]]
            continue
        elif name == "reshape" and repeat and out.repeat is None:
            found = _repeat(g, node, out.axes)
            if found is None:
                break
            src, axes, rep, bnode = found
            out.repeat, out.axes = rep, axes
            out.nodes += [n, bnode]
            out.src = src
            continue
        else:
            break
        out.nodes.append(n)
        out.src = node.ins[0]
    return out


def _repeat(
    g: Graph, reshape: Node, axes: tuple[int, ...]
) -> tuple[Atom, tuple[int, ...], tuple[int, int], int] | None:
    """`reshape(broadcast_in_dim(x))` repeating one axis of `x` (`jnp.repeat`): `(x,
    x's axes as operand axes, (operand axis, times), broadcast node)`."""
    b = reshape.ins[0]
    bnode = g.node_of(b)
    if (
        not isinstance(b, int)
        or bnode is None
        or bnode.name != "broadcast_in_dim"
        or g.n_readers(b) != 1
        or len(g.top_nodes[bnode.top]) != 1
    ):
        return None
    bshape, rshape = g.shape(b), g.shape(reshape.outs[0])
    if len(bshape) != len(rshape) + 1:
        return None
    m = next((i for i in range(len(rshape)) if bshape[i] != rshape[i]), len(rshape) - 1)
    if bshape[:m] + (bshape[m] * bshape[m + 1],) + bshape[m + 2 :] != rshape:
        return None
    dims = tuple(bnode.params["broadcast_dimensions"])
    src = bnode.ins[0]
    if dims != tuple(d for d in range(len(bshape)) if d != m + 1) or g.shape(src) != tuple(bshape[d] for d in dims):
        return None
    src_axes = tuple(axes[d if d <= m else d - 1] for d in dims)
    return src, src_axes, (axes[m], bshape[m + 1]), g.producer[b]
