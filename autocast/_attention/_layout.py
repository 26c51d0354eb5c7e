"""Axis bookkeeping: every value along the attention span is described by an *axis map*,
one entry per axis: the axis of the scores (the `q . k` product's output) it is, or `-1`
for a size-1 axis the scores lack. Layout equations (`transpose`, size-1 `reshape` and
`broadcast_in_dim`) change the map, never the roles; side values (masks, biases,
lengths) are brought to the scores' axes and from there to the kernel's `[B, N, T, S]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._match import Layout

AxisMap = tuple[int, ...]
HV = -2  # the value head dimension in an output axis map


def operand(shape: Sequence[int], amap: AxisMap) -> AxisMap:
    """The map of an elementwise equation's operand of `shape` (its result has map
    `amap`): the same axes, or none for a rank-0 operand (JAX broadcasts scalars)."""
    if len(shape) == len(amap):
        return amap
    if len(shape) == 0:
        return ()
    raise ValueError(f"an operand of rank {len(shape)} in an equation of rank {len(amap)}")


def transposed(amap: AxisMap, perm: Sequence[int]) -> AxisMap:
    """The map of `transpose(x, perm)` for `x` with map `amap`."""
    return tuple(amap[p] for p in perm)


def untransposed(amap: AxisMap, perm: Sequence[int]) -> AxisMap:
    """The map of `x` given the map of `transpose(x, perm)`."""
    out = [-1] * len(perm)
    for j, p in enumerate(perm):
        out[p] = amap[j]
    return tuple(out)


def reshaped(in_shape: Sequence[int], out_shape: Sequence[int], amap: AxisMap) -> AxisMap | None:
    """The map after a reshape that only inserts or removes size-1 axes (None otherwise)."""
    kept = [m for s, m in zip(in_shape, amap) if s != 1]
    idx = [i for i, s in enumerate(out_shape) if s != 1]
    if [s for s in in_shape if s != 1] != [out_shape[i] for i in idx]:
        return None
    out = [-1] * len(out_shape)
    for m, i in zip(kept, idx):
        out[i] = m
    return tuple(out)


def broadcast_inserts(in_shape: Sequence[int], out_shape: Sequence[int], dims: Sequence[int]) -> bool:
    """Whether `broadcast_in_dim` only inserts size-1 axes (moves no data)."""
    return all(out_shape[d] == s for d, s in zip(dims, in_shape)) and all(
        out_shape[i] == 1 for i in range(len(out_shape)) if i not in dims
    )


def through_broadcast(amap: AxisMap, dims: Sequence[int]) -> AxisMap:
    """The map of a `broadcast_in_dim` operand given the map of its result."""
    return tuple(amap[d] for d in dims)


def to_scores(x: Any, amap: AxisMap, rank: int, xp: Any = np) -> Any:
    """`x` (axis map `amap`) as an array broadcastable to the scores (rank `rank`)."""
    drop = tuple(i for i, m in enumerate(amap) if m < 0)
    if drop:
        x = xp.squeeze(x, axis=drop)
    mapped = [m for m in amap if m >= 0]
    order = sorted(range(len(mapped)), key=lambda i: mapped[i])
    x = xp.transpose(x, order)
    shape = [1] * rank
    for j, i in enumerate(order):
        shape[mapped[i]] = x.shape[j]
    return xp.reshape(x, shape)


def side_to_kernel(x: Any, layout: Layout, xp: Any = jnp) -> Any:
    """A value broadcastable to the scores as the kernel's `[B|1, N|1, T, S]` (queries and
    keys broadcast to their full extent: cuDNN rejects a broadcast `T` or `S`)."""
    heads = ([layout.heads] if layout.heads is not None else []) + list(layout.groups)
    order = [*layout.batch, *heads, layout.t, layout.s]
    x = xp.transpose(x, order)
    full = [layout.lout_shape[a] for a in order]
    nb, nh = len(layout.batch), len(heads)
    target = list(x.shape)
    for lo, hi in ((0, nb), (nb, nb + nh)):
        if any(x.shape[i] != 1 for i in range(lo, hi)):
            target[lo:hi] = full[lo:hi]
    target[-2:] = full[-2:]
    x = xp.broadcast_to(x, target)
    return xp.reshape(x, (math.prod(target[:nb]), math.prod(target[nb : nb + nh]), target[-2], target[-1]))


def lengths_to_kernel(x: Any, layout: Layout) -> Any:
    """A per-batch length broadcastable to the scores as the kernel's int32 `[B]`."""
    others = tuple(i for i in range(x.ndim) if i not in layout.batch)
    x = jnp.squeeze(x, axis=others) if others else x
    x = jnp.broadcast_to(x, [layout.lout_shape[a] for a in layout.batch])
    return jnp.reshape(x, (-1,)).astype(jnp.int32)


def kernel_out_to_output(out: Any, layout: Layout) -> Any:
    """The kernel's `[B, T, N, Hv]` output in the span's output layout."""
    heads = ([layout.heads] if layout.heads is not None else []) + list(layout.groups)
    labels = [*layout.batch, layout.t, *heads, HV]
    sizes = [layout.lout_shape[a] for a in labels[:-1]] + [out.shape[-1]]
    out = jnp.reshape(out, sizes)
    perm = [labels.index(m) for m in layout.out_amap if m != -1]
    out = jnp.transpose(out, perm)
    for i, m in enumerate(layout.out_amap):
        if m == -1:
            out = jnp.expand_dims(out, i)
    return out
