"""`call_hi_primitive`: the hijax encodings of checkpoint, custom_jvp, custom_vjp and scan.

From JAX 0.12 (behind `jax_remat3`, `jax_custom_jvp3`, `jax_custom_vjp3` and
`jax_scan3`; `jax_custom_vjp3` also in 0.9.2) each of these constructs is one
`call_hi_primitive` equation whose `_prim` parameter holds the body and the rules. One
handler dispatches on what it holds, to the same logic the old encodings get
(`autocast._higher_order`), so each behaves under amp as its non-hijax twin:

- `RematTraced`: the body specialised to the arriving dtypes, rebuilt with the same policy
  and `prevent_cse`; `checkpoint_name` (`CheckpointName`) keeps its value's dtype.
- `CustomJVPTraced` / `CustomVJPTraced`: rebuilt through `jax.custom_jvp` /
  `jax.custom_vjp` with the rules called as values arrive.
- `Scan3`: the body specialised to the arriving dtypes (loop carries are mutable refs: they
  keep the dtype they were made with); the scan is rebuilt around it.
- anything else (`SearchSorted`, ...): operands in their traced dtypes, bound as is.

The planner sees through `RematTraced` and `CustomJVPTraced` bodies as through
`checkpoint` and `custom_jvp_call` ones (`_constructs.narrow_body`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _compat, _constructs
from ._custom_derivatives import call_computes_in_float32, custom_jvp, custom_jvp_pulls, custom_vjp
from ._higher_order import checkpoint, checkpoint_pulls, current_dtypes, hi_original
from ._interpreter import Context, original_dtypes, transform_jaxpr
from ._registry import register_higher_order


def _float32_call(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
    return _compat.hi_name(eqn) == "CustomJVPTraced" and call_computes_in_float32(ctx, eqn, scopes, out32)


def _pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    if _compat.hi_name(eqn) == "CustomJVPTraced":
        return custom_jvp_pulls(ctx, eqn, scopes, out32)
    return checkpoint_pulls(ctx, eqn, scopes, out32)


def _checkpoint_name(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    return _constructs.checkpoint_name_bind(eqn, invals[0]), [in_free[0]]


def _scan3(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """`Scan3`: the body specialised to the arriving dtypes; its outputs (the stacked
    `ys`) keep the dtypes the body computes."""
    parts = _constructs.scan3_parts(eqn)
    if parts is None:
        return hi_original(ctx, eqn, invals, in_free, scopes)
    body, _ = parts
    in_dtypes = current_dtypes(invals, original_dtypes(eqn))
    free = [False if _compat.is_ref(x) else f for x, f in zip(invals, in_free)]
    new, extra, out_free = transform_jaxpr(ctx, body, in_dtypes, free, scopes, out_float32=out32)
    return _constructs.scan3_bind(eqn, new, extra, invals), out_free


@register_higher_order(
    _compat.call_hi_primitive_p, pulls=_pulls, body=_constructs.narrow_body, float32_call=_float32_call
)
def _call_hi(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    if _constructs.remat_parts(eqn) is not None:
        return checkpoint(ctx, eqn, invals, in_free, scopes, out32)
    name = _compat.hi_name(eqn)
    if name == "CustomJVPTraced":
        return custom_jvp(ctx, eqn, invals, in_free, scopes, out32)
    if name == "CustomVJPTraced":
        return custom_vjp(ctx, eqn, invals, in_free, scopes, out32)
    if _constructs.scan3_parts(eqn) is not None:
        return _scan3(ctx, eqn, invals, in_free, scopes, out32)
    if _constructs.is_checkpoint_name(eqn):
        return _checkpoint_name(ctx, eqn, invals, in_free, scopes, out32)
    return hi_original(ctx, eqn, invals, in_free, scopes)
