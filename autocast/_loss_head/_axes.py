"""Row-locality, one primitive at a time: which axis of each operand and result is the
*token* axis a loss head is chunked along, and the equation's parameters at chunk size.

A value of the loss chain is *chunked* along one axis (`int`): chunk `i` of it (the `i`-th of
`k` equal, contiguous blocks of that axis) is computed from chunk `i` of the chunked values
the equation reads and from whole values (`None`: the same for every chunk: the weight, a
scalar, a class-weight vector). An equation is row-local if there is such an assignment for
its operands and results; `relate` completes the one the finder knows so far, or raises
`NotLocal` with the reason. A reduction over the token axis ends the chain: its result is
the sum (`SUM`) or the maximum (`MAX`) of the chunks' results.

`at_chunk` gives an equation's parameters for chunks (the shapes in its parameters divided
by `k` along the token axis): the replay binds the user's own equations on chunks with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _vocab

SUM = "sum"
"""A result summed over the tokens (a `reduce_sum` whose axes include the token axis)."""

MAX = "max"
"""A result maximised (or, for `reduce_min`, minimised) over the tokens."""

Axis = int | str | None
"""The token axis of a value (`int`), none (`None`: whole), or how it ends (`SUM`, `MAX`)."""

Slot = tuple[str, int]
"""An operand (`("in", i)`) or a result (`("out", j)`) of one equation."""


class NotLocal(Exception):
    """The equation is not row-local along the token axis (the message says why)."""


def relate(
    name: str, params: Mapping[str, Any], ins: Sequence[Any], outs: Sequence[Any], known: Mapping[Slot, int]
) -> dict[Slot, Axis]:
    """Complete an assignment of token axes for one equation.

    Args:
        name: The primitive's name.
        params: Its parameters.
        ins: Its operands' abstract values.
        outs: Its results' abstract values.
        known: The token axes known so far (operands and results).

    Returns:
        The token axis of every operand and result (`None`: whole; `SUM`/`MAX` for a
            result reduced over the tokens).

    Raises:
        NotLocal: No row-local assignment agrees with `known`.
    """
    shapes_in = [tuple(int(n) for n in a.shape) for a in ins]
    shapes_out = [tuple(int(n) for n in a.shape) for a in outs]
    if name in _vocab.ELEMENTWISE:
        result = _elementwise(shapes_in, shapes_out, known)
    else:
        rule = _RULES.get(name)
        if rule is None:
            raise NotLocal(f"`{name}` is not known to be row-local")
        result = rule(params, shapes_in, shapes_out, known)
    # dimension numbers may hold NumPy integers (under `vmap`): axes are plain ints
    return {s: (int(v) if isinstance(v, np.integer) else v) for s, v in result.items()}


def _agree(slots: Sequence[Slot], known: Mapping[Slot, int]) -> int | None:
    found = {known[s] for s in slots if s in known}
    if len(found) > 1:
        raise NotLocal(f"its operands are chunked along different axes {sorted(found)}")
    return found.pop() if found else None


def _elementwise(shapes_in, shapes_out, known) -> dict[Slot, Axis]:
    """Operands of one shape, scalars, or (JAX >= 0.10's implicit broadcasting) operands of
    size 1 along an axis: those are whole along it."""
    slots = [("in", i) for i, s in enumerate(shapes_in) if s] + [("out", j) for j, s in enumerate(shapes_out) if s]
    axis = _agree(slots, known)
    out: dict[Slot, Axis] = {("in", i): None for i in range(len(shapes_in))}
    out.update({("out", j): None for j in range(len(shapes_out))})
    if axis is not None:
        size = max(_shape_of(s, shapes_in, shapes_out)[axis] for s in slots)
        for s in slots:
            n = _shape_of(s, shapes_in, shapes_out)[axis]
            if n == size:
                out[s] = axis
            elif n != 1 or s in known:
                raise NotLocal("an operand broadcasts along the tokens")
    return out


def _shape_of(
    slot: Slot, shapes_in: Sequence[tuple[int, ...]], shapes_out: Sequence[tuple[int, ...]]
) -> tuple[int, ...]:
    return shapes_in[slot[1]] if slot[0] == "in" else shapes_out[slot[1]]


def _one_to_one(forward: Mapping[int, int], known, n_in: int = 1, creates: bool = False) -> dict[Slot, Axis]:
    """One operand, one result, whose token axes correspond by `forward` (operand axis ->
    result axis; an axis not in it cannot be the token axis). `creates`: a result axis not in
    it is made here from a whole operand (a broadcast); otherwise it cannot be the token axis."""
    back = {v: k for k, v in forward.items()}
    a, b = known.get(("in", 0)), known.get(("out", 0))
    if a is not None:
        if a not in forward:
            raise NotLocal(f"axis {a} does not survive it")
        if b is not None and forward[a] != b:
            raise NotLocal("its operand and result are chunked along different axes")
        b = forward[a]
    elif b is not None:
        a = back.get(b)  # None: the result's token axis is made here (a broadcast); the operand is whole
        if a is None and not creates:
            raise NotLocal(f"axis {b} of its result is no chunk of its operand")
    result: dict[Slot, Axis] = {("in", i): None for i in range(n_in)}
    result[("in", 0)] = a
    result[("out", 0)] = b
    return result


def _transpose(params, shapes_in, shapes_out, known):
    perm = params["permutation"]
    return _one_to_one({p: i for i, p in enumerate(perm)}, known)


def _broadcast_in_dim(params, shapes_in, shapes_out, known):
    (src,), (dst,) = shapes_in[:1], shapes_out
    dims = params["broadcast_dimensions"]
    forward = {i: d for i, d in enumerate(dims) if src[i] == dst[d]}
    if known.get(("in", 0)) is None and ("out", 0) in known and known[("out", 0)] in dims:
        i = list(dims).index(known[("out", 0)])
        if src[i] != dst[known[("out", 0)]]:  # broadcast from size 1 along the tokens: whole operand
            forward.pop(i, None)
    return _one_to_one(forward, known, len(shapes_in), creates=True)


def _squeeze(params, shapes_in, shapes_out, known):
    gone = set(params["dimensions"])
    kept = [i for i in range(len(shapes_in[0])) if i not in gone]
    return _one_to_one({a: j for j, a in enumerate(kept)}, known)


def _reshape_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Operand axis -> result axis where chunking one is chunking the other: axes at the same
    flat offset (the product of the sizes before them) with equal products after them,
    neither of size 1 (a split or merge keeps the first axis of a group; `k` must divide
    both sizes)."""

    def offsets(shape):
        out, p = {}, 1
        for i, n in enumerate(shape):
            if n != 1:
                out.setdefault(p, i)
            p *= n
        return out

    a, b = offsets(src), offsets(dst)
    return {a[p]: b[p] for p in a if p in b}


def _reshape(params, shapes_in, shapes_out, known):
    if params.get("dimensions") is not None:
        raise NotLocal("a reshape with `dimensions`")
    return _one_to_one(_reshape_map(shapes_in[0], shapes_out[0]), known, len(shapes_in))


def _reduce(kind: str):
    def rule(params, shapes_in, shapes_out, known):
        axes = set(params["axes"])
        a = known.get(("in", 0))
        b = known.get(("out", 0))
        kept = [i for i in range(len(shapes_in[0])) if i not in axes]
        if a is not None and a in axes:
            if kind == "":
                raise NotLocal("it reduces over the tokens")
            return {("in", 0): a, ("out", 0): kind}
        return _one_to_one(
            {i: j for j, i in enumerate(kept)}, {("in", 0): a, ("out", 0): b} if b is not None or a is not None else {}
        )

    return rule


def _iota(params, shapes_in, shapes_out, known):
    b = known.get(("out", 0))
    if b is not None and b == params["dimension"]:
        raise NotLocal("it counts along the tokens")
    return {("out", 0): b}


def _slice(params, shapes_in, shapes_out, known):
    shape = shapes_in[0]
    strides = params.get("strides") or (1,) * len(shape)
    full = {
        i: i
        for i in range(len(shape))
        if params["start_indices"][i] == 0 and params["limit_indices"][i] == shape[i] and strides[i] == 1
    }
    return _one_to_one(full, known)


def _pad(params, shapes_in, shapes_out, known):
    free = {i: i for i, cfg in enumerate(params["padding_config"]) if tuple(cfg) == (0, 0, 0)}
    return _one_to_one(free, known, 2)


def _along(key: str):
    """Operands and results of one shape that act along the axis `params[key]` (a
    cumulative sum, a sort, a concatenation): row-local along any other axis."""

    def rule(params, shapes_in, shapes_out, known):
        result = _elementwise(shapes_in, shapes_out, known)
        axis = _agree(list(known), known)
        if axis is not None and axis == params[key]:
            raise NotLocal(f"it acts along the tokens ({key}={axis})")
        return result

    return rule


def _gather(params, shapes_in, shapes_out, known):
    dn = params["dimension_numbers"]
    operand, indices = shapes_in
    batching = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
    offset_operand = [i for i in range(len(operand)) if i not in dn.collapsed_slice_dims and i not in batching]
    out_offset = dict(zip(offset_operand, dn.offset_dims))
    out_rank = len(shapes_out[0])
    out_batch = [d for d in range(out_rank) if d not in dn.offset_dims]  # indices dims but the last, in order
    index_of_out = dict(zip(out_batch, range(len(indices) - 1)))
    out_of_index = {v: k for k, v in index_of_out.items()}
    a, b, o = known.get(("in", 0)), known.get(("in", 1)), known.get(("out", 0))
    # the result's token axis decides the others
    if o is None:
        if a is not None:
            if a in batching:
                o = out_of_index[batching[a]]
            elif a in out_offset and a not in dn.start_index_map and params["slice_sizes"][a] == operand[a]:
                o = out_offset[a]
            else:
                raise NotLocal("it indexes the logits along the tokens")
        elif b is not None:
            if b == len(indices) - 1:
                raise NotLocal("the token axis is the index vector")
            o = out_of_index[b]
        else:
            return {("in", 0): None, ("in", 1): None, ("out", 0): None}
    if o in dn.offset_dims:
        a2 = offset_operand[list(dn.offset_dims).index(o)]
        if a2 in dn.start_index_map or params["slice_sizes"][a2] != operand[a2]:
            raise NotLocal("it slices the logits along the tokens")
        b2 = None
    else:
        b2 = index_of_out[o]
        inverse = {v: k for k, v in batching.items()}
        a2 = inverse.get(b2)
    if (a is not None and a != a2) or (b is not None and b != b2):
        raise NotLocal("its operand and indices are chunked along different axes")
    return {("in", 0): a2, ("in", 1): b2, ("out", 0): o}


_RULES = {
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "reduce_sum": _reduce(SUM),
    "reduce_max": _reduce(MAX),
    "reduce_min": _reduce(MAX),
    "reduce_prod": _reduce(""),
    "reduce_and": _reduce(""),
    "reduce_or": _reduce(""),
    "argmax": _reduce(""),
    "argmin": _reduce(""),
    "iota": _iota,
    "slice": _slice,
    "pad": _pad,
    "gather": _gather,
    "cumsum": _along("axis"),
    "cumlogsumexp": _along("axis"),
    "cummax": _along("axis"),
    "cummin": _along("axis"),
    "cumprod": _along("axis"),
    "concatenate": _along("dimension"),
    "sort": _along("dimension"),
}


def at_chunk(name: str, params: Mapping[str, Any], axes: Mapping[Slot, Axis], k: int) -> dict[str, Any]:
    """The equation's parameters for chunks of `1/k` of its token axis (`axes`, from `relate`)."""
    params = dict(params)
    out = axes.get(("out", 0))
    if name == "reshape" and isinstance(out, int):
        params["new_sizes"] = _divided(params["new_sizes"], out, k)
    elif name in ("broadcast_in_dim", "iota") and isinstance(out, int):
        params["shape"] = _divided(params["shape"], out, k)
    elif name == "gather":
        a = axes.get(("in", 0))
        if isinstance(a, int) and isinstance(out, int) and out in params["dimension_numbers"].offset_dims:
            params["slice_sizes"] = _divided(params["slice_sizes"], a, k)
    elif name == "slice" and isinstance(out, int):
        params["limit_indices"] = _divided(params["limit_indices"], out, k)
    return params


def _divided(shape: Sequence[int], axis: int, k: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[axis] //= k
    return tuple(shape)
