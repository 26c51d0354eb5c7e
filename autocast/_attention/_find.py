"""The recogniser: softmax anchors -> scores chain -> roles -> masks -> span -> Match."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat, _walk
from . import _layout, _mask, _roles, _scores, _span
from ._graph import Graph
from ._match import Layout, LeftAlone, Match, Operand, Program, Side
from ._softmax import Softmax, find_softmaxes

_HALF = ("float16", "bfloat16")
_JAXNN_FILL = float(np.float32(-0.7 * np.finfo(np.float32).max))


def find(
    jaxpr: Any, *, compute_dtype: Any, consts: Sequence[Any] = (), max_head_dim: int = 128
) -> list[Match | LeftAlone]:
    """The attention spans of `jaxpr`'s top-level equations (nested bodies are not
    entered, but the small `jit` calls and softmax `custom_jvp` calls a span crosses are).

    Args:
        jaxpr: An open or closed jaxpr.
        compute_dtype: `float16` or `bfloat16`, the dtype the kernel runs in.
        consts: The values of its constants, paired with `(*constvars, *invars)` as
            `autocast._compat.bind_inputs` pairs them (a closed jaxpr brings its own):
            constant masks are evaluated from them at trace time.
        max_head_dim: The largest head dimension to accept (128; cuDNN takes 256 on
            Hopper and later, which a trace cannot always see).

    Returns:
        One `Match` or `LeftAlone` per softmax that reads a `q . k` product and feeds a
        `p . v` product, in program order; spans never overlap.

    Raises:
        ValueError: `compute_dtype` is not a half dtype, or `max_head_dim` is not an
            int >= 8.
    """
    dtype = np.dtype(compute_dtype)
    if dtype.name not in _HALF:
        raise ValueError(f"find(compute_dtype={dtype.name!r}): the fused kernel runs in one of {_HALF}")
    if not isinstance(max_head_dim, int) or max_head_dim < 8:
        raise ValueError(f"find(max_head_dim={max_head_dim!r}): an int >= 8 is allowed")
    open_, own = _compat.open_and_consts(jaxpr)
    if not _has_exp(open_):
        return []
    known = dict(zip(open_.constvars, own)) if own else dict(zip([*open_.constvars, *open_.invars], consts))
    g = Graph(open_, known)
    out: list[Match | LeftAlone] = []
    taken: set[int] = set()
    for sm in find_softmaxes(g):
        try:
            res = _one(g, sm, dtype, max_head_dim, frozenset(taken))
        except Exception as e:  # a jaxpr the recogniser does not know: never fail amp's trace
            res = LeftAlone(sm.top, _guess(sm), f"not recognised ({type(e).__name__}: {e})")
        if isinstance(res, Match) and taken & set(res.eqns):
            res = LeftAlone(sm.top, res.idiom, "overlaps another attention span")
        if isinstance(res, Match):
            taken.update(res.eqns)
        if res is not None:
            out.append(res)
    return out


def _has_exp(jaxpr: Any, seen: dict[int, bool] | None = None) -> bool:
    seen = {} if seen is None else seen
    if id(jaxpr) in seen:
        return seen[id(jaxpr)]
    found = False
    for eqn in _compat.open_and_consts(jaxpr)[0].eqns:
        if eqn.primitive.name == "exp" or (
            _walk.kind(eqn) in ("jit", "custom_jvp") and any(_has_exp(b, seen) for b in _walk.bodies(eqn))
        ):
            found = True
            break
    seen[id(jaxpr)] = found
    return found


def _guess(sm: Softmax) -> str:
    return "einsum + softmax" + ("" if sm.form == "inline" else f" [softmax in {sm.form}]")


def _one(g: Graph, sm: Softmax, dtype: np.dtype, max_head_dim: int, taken: frozenset[int]) -> Match | LeftAlone | None:
    reasons = []
    for n, steps in _scores.paths(g, sm.x):
        try:
            scores = _scores.replay(g, steps, g.nodes[n])
            s = scores.amap[sm.axis]
            if scores.merges.of(s) is not None:
                raise _scores.Rejected("the softmax runs over axes of the product a reshape merged")
            if s < 0:
                raise _scores.Rejected("the softmax runs over an axis the product lacks")
            prod = _roles.product(g, n, s)
        except _scores.Rejected as e:
            reasons.append(str(e))
            continue
        try:
            return _build(g, sm, steps, scores, prod, dtype, max_head_dim, taken)
        except _scores.Rejected as e:  # the product found; left alone if p feeds a product
            return LeftAlone(sm.top, _guess(sm), str(e)) if _feeds_product(g, sm.p) else None
    if reasons and _feeds_product(g, sm.p):
        return LeftAlone(sm.top, _guess(sm), reasons[0])
    return None


def _feeds_product(g: Graph, p: int) -> bool:
    """Whether the probabilities reach a `dot_general` within a few elementwise steps."""
    frontier, seen = [p], set()
    for _ in range(8):
        nxt: list[int] = []
        for i in frontier:
            for r in g.readers.get(i, ()):
                node = g.nodes[r]
                if node.name == "dot_general":
                    return True
                if r not in seen and not node.opaque and not node.name.startswith(("reduce", "argm")):
                    seen.add(r)
                    nxt.extend(o for o in node.outs if o >= 0)
        frontier = nxt
    return False


def _build(
    g: Graph,
    sm: Softmax,
    steps: list[_scores.Step],
    scores: _scores.Scores,
    prod: _roles.Product,
    dtype: np.dtype,
    max_head_dim: int,
    taken: frozenset[int],
) -> Match:
    vp = _roles.value_product(g, sm.p, scores.amap, prod, scores.merges)
    qp = _roles.peel(g, prod.q, scale=True, repeat=False, taken=taken)
    kp = _roles.peel(g, prod.k, scale=True, repeat=True, taken=taken)
    vv = _roles.peel(g, vp.v, scale=False, repeat=True, taken=taken)
    repeat = None
    if kp.repeat and vv.repeat:
        ka, kt = kp.repeat
        va, vt = vv.repeat
        if prod.k_map[ka] == vp.v_map[va] and kt == vt:
            repeat = (prod.k_map[ka], kt)
    if repeat is None and (kp.repeat or vv.repeat):
        kp = _roles.peel(g, prod.k, scale=True, repeat=False, taken=taken)
        vv = _roles.peel(g, vp.v, scale=False, repeat=False, taken=taken)
    layout = _layout_of(g, prod, vp, qp, kp, vv, repeat)
    _span.unmerge_sides(g, scores)
    parts = _mask.classify(g, scores, layout)
    out_id, out_amap, tail, q_routed = _span.tail(g, g.nodes[vp.node].outs[0], vp.out_amap, parts.q_len, layout)
    layout = dataclasses.replace(layout, out_amap=out_amap)
    mask, const_mask, fold_fill = _mask.finish(parts, layout, q_routed)
    if parts.q_len is not None and not q_routed:  # an ordinary mask, then
        parts.masks.append(parts.q_len.leaf)
        parts.q_len = None
    _check_shapes(g, qp, vv, layout, max_head_dim)

    core = {prod.node, vp.node, *vp.steps, *tail, *sm.nodes, *qp.nodes, *kp.nodes, *vv.nodes}
    core.update(s.node for s in steps)
    tops = sorted({g.nodes[n].top for n in core})
    _span.check(g, set(tops), out_id, sm)

    lengths = [ln.side for ln in (parts.kv_len, parts.q_len) if ln is not None]
    factors, const_factor = _factors(g, vp, len(layout.lout_shape))
    roots = [
        _span.ident(qp.src),
        _span.ident(kp.src),
        _span.ident(vv.src),
        *(s.id for s in [*parts.masks, *parts.biases, *lengths, *factors]),
    ]
    input_ids, nodes, consts = _span.program(g, roots, set(tops), core)
    program = Program(
        input_ids,
        tuple(nodes),
        consts,
        _span.ident(qp.src),
        _span.ident(kp.src),
        _span.ident(vv.src),
        tuple(parts.masks),
        tuple(parts.biases),
        parts.kv_len.side if parts.kv_len else None,
        parts.q_len.side if parts.q_len else None,
        const_mask,
        parts.const_bias,
        fold_fill=fold_fill,
        bias_recipe=_mask.bias_recipe(parts),
        factors=tuple(factors),
        const_factor=const_factor,
    )
    inputs = tuple(g.var_of_id[i] for i in input_ids)
    out_aval = g.aval(out_id)
    scale = scores.scale * qp.scale * kp.scale
    kv_heads = layout.lout_shape[layout.heads] // layout.kv_repeat if layout.heads is not None else 1
    groups = layout.kv_repeat * int(np.prod([layout.lout_shape[a] for a in layout.groups], dtype=np.int64))
    return Match(
        eqns=tuple(tops),
        inputs=inputs,
        outputs=(g.var_of_id[out_id],),
        q=_operand(g, qp, prod.q_map, layout, input_ids),
        k=_operand(g, kp, prod.k_map, layout, input_ids),
        v=_operand(g, vv, vp.v_map, layout, input_ids),
        scale=scale,
        mask=mask,
        kv_heads=kv_heads,
        groups=groups,
        idiom=_idiom(sm, parts, qp, kp, layout, bool(scores.merges.parts), bool(vp.factors)),
        compute_dtype=dtype,
        out_shape=tuple(out_aval.shape),
        out_dtype=np.dtype(out_aval.dtype),
        layout=layout,
        program=program,
    )


def _layout_of(
    g: Graph,
    prod: _roles.Product,
    vp: _roles.ValueProduct,
    qp: _roles.Peeled,
    kp: _roles.Peeled,
    vv: _roles.Peeled,
    repeat: tuple[int, int] | None,
) -> Layout:
    nb = prod.n_batch
    q_score = [prod.q_map[a] for a in qp.axes]  # q src axis -> score axis
    if repeat is not None:
        heads: int | None = repeat[0]
    elif nb >= 2:
        heads = max(range(nb), key=lambda b: q_score.index(b))
    else:
        heads = None
    batch = tuple(b for b in range(nb) if b != heads)
    sizes = prod.shape
    t = max(prod.q_free, key=lambda a: (sizes[a], -a))
    groups = tuple(a for a in prod.q_free if a != t)
    hd = [heads] if heads is not None else []
    k_score = [prod.k_map[a] for a in kp.axes]
    v_score = [vp.v_map[a] for a in vv.axes]
    return Layout(
        lout_shape=tuple(sizes),
        batch=batch,
        heads=heads,
        groups=groups,
        t=t,
        s=prod.s,
        q_axes=tuple(q_score.index(r) for r in [*batch, t, *hd, *groups, _roles.H]),
        k_axes=tuple(k_score.index(r) for r in [*batch, prod.s, *hd, _roles.H]),
        v_axes=tuple(v_score.index(r) for r in [*batch, prod.s, *hd, _layout.HV]),
        kv_repeat=repeat[1] if repeat else 1,
        out_amap=vp.out_amap,
    )


def _check_shapes(g: Graph, qp: _roles.Peeled, vv: _roles.Peeled, layout: Layout, max_head_dim: int) -> None:
    qh = g.shape(qp.src)[layout.q_axes[-1]]
    vh = g.shape(vv.src)[layout.v_axes[-1]]
    if qh % 8 or qh > max_head_dim:
        raise _scores.Rejected(f"head dimension {qh}: cuDNN takes a multiple of 8, at most {max_head_dim}")
    if qh != vh:
        raise _scores.Rejected(f"q/k head dimension {qh} differs from v's {vh}")
    for p in (qp, vv):
        dt = np.dtype(g.aval(p.src).dtype)
        if dt.kind != "f" and dt.name not in _HALF:
            raise _scores.Rejected(f"an operand of dtype {dt.name}")


def _operand(
    g: Graph, p: _roles.Peeled, score_map: tuple[int, ...], layout: Layout, input_ids: tuple[int, ...]
) -> Operand:
    roles = []
    for a in p.axes:
        m = score_map[a]
        if m == _roles.H or m == _layout.HV:
            roles.append("H")
        elif m == layout.t:
            roles.append("T")
        elif m == layout.s:
            roles.append("S")
        elif m == layout.heads:
            roles.append("N")
        elif m in layout.groups:
            roles.append("G")
        else:
            roles.append("B")
    src = _span.ident(p.src)
    aval = g.aval(src)
    return Operand(input_ids.index(src), tuple(aval.shape), np.dtype(aval.dtype), tuple(roles))


def _factors(g: Graph, vp: _roles.ValueProduct, rank: int) -> tuple[list[Side], np.ndarray | None]:
    """The factors on the probabilities: the traced ones, and the product of the constant
    ones broadcastable to the scores (None where there is none, or it is all ones)."""
    traced: list[Side] = []
    const = None
    for atom, famap in vp.factors:
        if not g.foldable(atom):
            traced.append(Side(_span.ident(atom), famap))
            continue
        val = _layout.to_scores(np.asarray(g.value(atom), np.float32), famap, rank)
        const = val if const is None else const * val
    return traced, None if const is None or np.all(const == 1) else const


def _idiom(
    sm: Softmax,
    parts: _mask.Parts,
    qp: _roles.Peeled,
    kp: _roles.Peeled,
    layout: Layout,
    merged: bool = False,
    factors: bool = False,
) -> str:
    base = "jax.nn.dot_product_attention(xla)" if _JAXNN_FILL in parts.fills else "einsum + softmax"
    extras = []
    if qp.scale != 1.0 or kp.scale != 1.0:
        extras.append("scaled " + ("query" if qp.scale != 1.0 else "key"))
    if layout.kv_repeat > 1:
        extras.append("repeated kv heads")
    elif any(layout.lout_shape[a] > 1 for a in layout.groups):
        extras.append("grouped query heads")
    if merged:
        extras.append("scores reshaped")
    if factors:
        extras.append("factor on the probabilities")
    if parts.additive:
        extras.append("additive mask")
    if sm.form != "inline":
        extras.append(f"softmax in {sm.form}")
    return base + (f" [{', '.join(extras)}]" if extras else "")
