"""Axis bookkeeping: every value along the attention span is described by an *axis map*,
one entry per axis: the axis of the scores (the `q . k` product's output) it is, or `-1`
for a size-1 axis the scores lack. Layout equations (`transpose`, size-1 `reshape` and
`broadcast_in_dim`) change the map, never the roles; side values (masks, biases,
lengths, factors) are brought to the scores' axes and from there to the kernel's
`[B, N, T, S]` (or, for a factor on the probabilities, to the output's layout).

A reshape may also merge adjacent axes of the scores into one and split it back (grouped
query heads written as scores `[B, T, K, G, S] -> [B, T, K * G, S]` and probabilities
reshaped back before the value product: Gemma, Flax NNX). A merged axis has the entry
`MERGED - j` in a map, `Merges.parts[j]` naming the score axes it holds (major first). The
merge never reaches the kernel: q, k, v and the output keep their own axes, so a merge the
probabilities undo (`regrouped`) is a relabelling, whatever the order of its parts; only a
side value that varies along a merged axis has to be split into those parts
(`split_merged`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._match import Layout

AxisMap = tuple[int, ...]
HV = -2  # the value head dimension in an output axis map
MERGED = -10  # entries at or below this are axes a reshape merged (`Merges`)


@dataclass
class Merges:
    """The score axes reshapes merged into one, along one span: the axis-map entry
    `MERGED - j` stands for `parts[j]` (score axes, major first); `sizes` holds the size of
    each score axis a merge took."""

    parts: list[tuple[int, ...]] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)

    def of(self, entry: int) -> tuple[int, ...] | None:
        """The score axes a merged entry holds (None for any other entry)."""
        j = MERGED - entry
        return self.parts[j] if 0 <= j < len(self.parts) else None

    def entry(self, parts: tuple[int, ...]) -> int:
        """The entry of the axis that holds `parts` (one score axis: that axis)."""
        if len(parts) == 1:
            return parts[0]
        if parts not in self.parts:
            self.parts.append(parts)
        return MERGED - self.parts.index(parts)

    def flatten(self, entries: Iterable[int], sizes: Iterable[int]) -> tuple[int, ...] | None:
        out: list[int] = []
        for e, size in zip(entries, sizes):
            inner = self.of(e)
            if inner is not None:
                out.extend(inner)
            elif e >= 0:
                self.sizes[e] = size
                out.append(e)
            else:  # a size-1 axis, or a head dimension: not an axis of the scores to merge
                return None
        return tuple(out)


def merged(amap: AxisMap) -> bool:
    """Whether `amap` holds an axis a reshape merged."""
    return any(m <= MERGED for m in amap)


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


def regrouped(
    in_shape: Sequence[int], out_shape: Sequence[int], amap: AxisMap, merges: Merges | None = None
) -> AxisMap | None:
    """The map after a reshape of a value with map `amap`, or None where the reshape does
    more than this: insert or remove size-1 axes and, with `merges` (which it extends),
    merge adjacent axes into one or split a merged axis into its parts (or into runs of
    them), in order and at their sizes."""
    ins = [i for i, d in enumerate(in_shape) if d != 1]
    outs = [j for j, d in enumerate(out_shape) if d != 1]
    out = [-1] * len(out_shape)
    a = b = 0
    while a < len(ins) and b < len(outs):
        gi, go = [ins[a]], [outs[b]]
        si, so = in_shape[ins[a]], out_shape[outs[b]]
        a, b = a + 1, b + 1
        while si != so:
            if si < so and a < len(ins):
                gi.append(ins[a])
                si, a = si * in_shape[ins[a]], a + 1
            elif so < si and b < len(outs):
                go.append(outs[b])
                so, b = so * out_shape[outs[b]], b + 1
            else:
                return None
        if len(gi) == 1 and len(go) == 1:
            out[go[0]] = amap[gi[0]]
        elif merges is None or (len(gi) > 1 and len(go) > 1):
            return None
        elif len(go) == 1:
            parts = merges.flatten((amap[i] for i in gi), (in_shape[i] for i in gi))
            if parts is None:
                return None
            out[go[0]] = merges.entry(parts)
        else:
            runs = _split(merges, amap[gi[0]], [out_shape[j] for j in go])
            if runs is None:
                return None
            for j, run in zip(go, runs):
                out[j] = merges.entry(run)
    if a < len(ins) or b < len(outs):
        return None
    return tuple(out)


def _split(merges: Merges, entry: int, sizes: Sequence[int]) -> list[tuple[int, ...]] | None:
    """The parts of a merged entry in consecutive runs of the sizes `sizes` (None if the
    reshape splits it otherwise: another grouping than the merge's)."""
    parts = merges.of(entry)
    if parts is None:
        return None
    runs, k = [], 0
    for size in sizes:
        run, n = [], 1
        while n < size and k < len(parts):
            n *= merges.sizes[parts[k]]
            run.append(parts[k])
            k += 1
        if n != size:
            return None
        runs.append(tuple(run))
    return runs if k == len(parts) else None


def split_merged(x: Any, amap: AxisMap, merges: Merges) -> tuple[Any, AxisMap]:
    """A constant `x` (NumPy, axis map `amap`) with each merged axis reshaped into its
    parts (row-major, as the reshape that merged them): `(value, its map)` with score axes
    only."""
    shape: list[int] = []
    out: list[int] = []
    for d, m in zip(np.shape(x), amap):
        parts = merges.of(m)
        if parts is None or d == 1:
            shape.append(d)
            out.append(-1 if parts is not None else m)
        else:
            shape.extend(merges.sizes[p] for p in parts)
            out.extend(parts)
    return np.reshape(x, shape), tuple(out)


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


def scores_to_output(x: Any, out_amap: AxisMap, xp: Any = jnp) -> Any:
    """`x`, broadcastable to the scores and of size 1 along each score axis the output
    lacks (the keys), in the output's layout (`out_amap`: a score axis, `HV` or -1)."""
    keep = [m for m in out_amap if m >= 0]
    drop = tuple(a for a in range(x.ndim) if a not in keep)
    x = xp.squeeze(x, axis=drop) if drop else x
    order = sorted(keep)
    x = xp.transpose(x, [order.index(m) for m in keep])
    for i, m in enumerate(out_amap):
        if m < 0:
            x = xp.expand_dims(x, i)
    return x


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
