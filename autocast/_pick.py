"""A per-row pick (`take_along_axis` of one index per row: a cross-entropy's label logit) as
a masked sum over the picked axis, for `_rules.select_in_float32`.

`x[..., labels[...], ...]` picked from the float32 conversion of half-precision logits
that a `logsumexp` also reads: as a `gather`, XLA:TPU keeps the conversion in memory for it
(the gather does not fuse its operand) and its transpose is a scatter. As
`sum(where(iota == label, x, 0))` over the axis it is one more reduction over the value the
`logsumexp` reduces, fused with it, and its transpose an elementwise select: GPT-2 small's
v5e step, temp 2,931 -> 2,735 MiB, bytes accessed 49.2 -> 48.6 GB (deviceless, 2026-11-28).
XLA:GPU is the other way round: the masked sum cost GPT-2 small's H100 step 1,079 MiB more
temp and 0.9 ms (deviceless, the same day: benchmarks/results/tpu_modeled/findings.md, fourth
pass). So `pick` emits the masked sum in a `lax.platform_dependent` branch for TPUs, the
gather elsewhere, and only where a program traced here can be compiled for a TPU
(`_compat.tpu_compiler`): on other machines the program is the gather alone, as before.

The same values: the sum adds one element to zeros (exact in any float dtype; an element of
-0.0 becomes +0.0), the other elements are selected away (a NaN or an infinity elsewhere in
the row is not read), and the gather's modes are kept: an index out of bounds gives the
fill value under `FILL_OR_DROP` and is clamped under `CLIP` (and `PROMISE_IN_BOUNDS`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat


def row_axis(params: dict[str, Any], operand_shape: tuple[int, ...], indices_shape: tuple[int, ...]) -> int | None:
    """The operand axis a `gather` picks one element of per row, or None where it is not
    such a pick (`offset_dims` empty, one start index along one collapsed axis, every other
    operand axis a batching axis, and each batch element one index)."""
    dn = params["dimension_numbers"]
    if tuple(dn.offset_dims) or len(dn.start_index_map) != 1:
        return None
    (axis,) = dn.start_index_map
    if tuple(dn.collapsed_slice_dims) != (axis,) or any(s != 1 for s in params["slice_sizes"]):
        return None
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if sorted((*batching, axis)) != list(range(len(operand_shape))):
        return None
    if not indices_shape or indices_shape[-1] != 1:
        return None
    per_row = set(getattr(dn, "start_indices_batching_dims", ()))
    if any(n != 1 for d, n in enumerate(indices_shape[:-1]) if d not in per_row):
        return None
    return axis


def masked(x: Any, indices: Any, params: dict[str, Any], axis: int) -> Any:
    """The `gather` of `params` (a pick along `axis`, `row_axis`) of `x` at `indices`,
    computed as a masked sum over `axis`."""
    dn = params["dimension_numbers"]
    out_shape = tuple(indices.shape[:-1])
    idx = indices[..., 0]
    size = x.shape[axis]
    pairs = sorted(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    rows = jnp.transpose(x, [o for _, o in pairs] + [axis])  # the batching axes in the result's order
    rows = lax.broadcast_in_dim(rows, (*out_shape, size), tuple(i for i, _ in pairs) + (len(out_shape),))
    fill = params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    inside = (idx >= 0) & (idx < size)
    if not fill:
        idx = jnp.clip(idx, 0, size - 1)
    hit = lax.broadcasted_iota(idx.dtype, (*out_shape, size), len(out_shape)) == idx[..., None]
    out = jnp.sum(jnp.where(hit, rows, jnp.zeros((), rows.dtype)), axis=-1)
    if fill:
        value = params.get("fill_value")
        out = jnp.where(inside, out, jnp.asarray(np.nan if value is None else value, out.dtype))
    return out


_ON: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("autocast_pick_on", default=None)


def platforms() -> tuple[str, ...]:
    """The `lax.platform_dependent` branches that pick with a masked sum: `("tpu",)` where a
    program traced here can be compiled for a TPU, else none (see `masked_on`)."""
    on = _ON.get()
    if on is not None:
        return on
    return ("tpu",) if _compat.tpu_compiler() else ()


@contextlib.contextmanager
def masked_on(*names: str) -> Iterator[None]:
    """Within the block, amp picks with a masked sum on the platforms `names` (for tests:
    `masked_on("cpu")` runs it on this machine; `masked_on()`, nowhere)."""
    token = _ON.set(tuple(names))
    try:
        yield
    finally:
        _ON.reset(token)


def pick(x: Any, indices: Any, params: dict[str, Any], axis: int, gather: Callable[[Any, Any], Any]) -> Any:
    """`gather(x, indices)`, a pick along `axis`: as a masked sum on the platforms of
    `platforms()`, as the gather elsewhere."""
    names = platforms()
    if not names:
        return gather(x, indices)
    branches = {name: lambda x, i: masked(x, i, params, axis) for name in names}
    return jax.lax.platform_dependent(x, indices, default=gather, **branches)
