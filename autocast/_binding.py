"""Binding an equation: its rule's cast, checked, and the binding that keeps gradients in float32.

`cast` applies an equation's rule to its operands as they arrive (switching a harmonising
rule to float32 where a concrete constant would overflow the half dtype, and saturating
narrowed fills), and checks what the rule returned: the pair `(operands, params)`, one
operand per operand, only float operands changed and only to a floating dtype.
`bind` then binds the equation on what the rule returned: through the rule's own
`autocast.Rule.bind` where it binds the equation itself; as a matmul with a float32
result or a float32 weight gradient (`autocast._wide`); or, for an operand narrowed
from float32 that the primitive broadcasts (a bias), broadcasting it in float32 first so
its gradient is summed in float32 (`bind_broadcast_in_float32`,
`_bind_bias_summed_apart`). `out_free` says which results are free values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from . import _compat, _cpu_matmul, _dtypes, _plan, _rules, _wide

# Primitives whose output is only a rearrangement (or a conversion) of their float
# operands: a value made by them from free values is free too.
STRUCTURAL = _plan.LAYOUT | {
    "broadcast_to",
    "convert_element_type",
    "device_put",
    "gather",
    "iota",
    "reshard",
    "select_n",
    "sharding_constraint",
    "stop_gradient",
    "tile",
}
# ... and sums of free values: ``embedding + position`` is still made from parameters only,
# so a half-precision activation added to it keeps it half (as a bias add would).
SUMS = frozenset({"add", "sub", "neg", "add_any"})
SCATTERS = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"})
#: The free flag of a value made only from literals (``jnp.zeros``, ``jnp.full``): free,
#: and known to be a constant (truthy wherever a free flag is tested).
LITERAL = "literal"

# Elementwise primitives that broadcast size-1 (and rank-0) operands implicitly. Autodiff
# transposes that broadcast into a ``reduce_sum`` in the dtype of the operand as bound.
_IMPLICIT_BROADCAST = frozenset(
    {"add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "clamp", "select_n", "add_any"}
)
# ... of which these are linear in every float operand: autodiff saves none of them.
_LINEAR_BROADCAST = frozenset({"add", "sub", "select_n", "add_any"})


def original_dtypes(eqn: Any) -> list[Any]:
    return [v.aval.dtype for v in eqn.invars]


def bind_original(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Bind the equation exactly as traced (operands cast back to their traced dtypes)."""
    invals = [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(invals, original_dtypes(eqn))]
    return _cpu_matmul.bind(eqn.primitive, invals, dict(eqn.params))


def rule_name(rule: Any) -> str:
    return getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None) or repr(rule)


def cast(ctx: Any, eqn: Any, rule: _rules.Rule, invals: list[Any], in_free: list[Any]):
    """Apply `rule` to the operands of `eqn` as they arrive (`in_free`: their free
    flags): `(rule, operands, params)`, the rule being the one that applied (a harmonising
    rule switches to float32 where a concrete constant would overflow the half dtype)."""
    prim = eqn.primitive
    orig = original_dtypes(eqn)
    if rule.role == "input" and _overflowing_constant(prim, invals, in_free):
        rule = _rules.use_float32_precision
    with contextlib.ExitStack() as stack:
        fills = _traced_fills(prim, invals, in_free)
        for i, dtype in _float32_broadcasts_ahead(eqn, prim, invals):
            if i not in fills:
                make = functools.partial(_broadcast_cast, invals[i], eqn, dtype)
                stack.enter_context(_dtypes.cast_override(invals[i], dtype, make))
        for i in fills:
            for half in _dtypes.HALF:
                make = functools.partial(_dtypes.saturating_cast, invals[i], half)
                stack.enter_context(_dtypes.cast_override(invals[i], half, make))
        result = rule.cast(ctx.compute_dtype, orig, list(invals), dict(eqn.params), in_free)
    new_invals, params = check_rule_result(result, prim, rule, invals, orig)
    return rule, new_invals, params


def bind(
    ctx: Any,
    eqn: Any,
    rule: _rules.Rule,
    invals: list[Any],
    new_invals: list[Any],
    params: dict[str, Any],
    in_free: list[Any],
    *,
    widen: bool = False,
    bias_sum: bool = False,
    scopes: tuple[str, ...] = (),
) -> list[Any]:
    """Bind `eqn` on the operands `rule` cast (`new_invals`, from `invals` as they
    arrived). `widen`: the planner lets this matmul store a float32 result (every reader
    computes in float32); `bias_sum`: its result is a matmul-plus-bias sum that feeds an
    expensive function (`autocast._plan.Plan.bias_sums`); `scopes`: the equation's named
    scopes (for the `autocast.RuleContext` a rule's own `bind` gets)."""
    prim = eqn.primitive
    # A rule may bind the equation itself (a float8 matmul, a fused attention kernel): it
    # gets the public context, the operands as they arrived and as it cast them, and returns
    # the outputs, or None to have the equation bound as usual.
    outs = None
    if type(rule).bind is not _rules.Rule.bind:  # (the default binds nothing: no context made)
        outs = rule.bind(ctx.for_rule(scopes), eqn, invals, new_invals, params, in_free)
    if outs is not None:
        return list(outs)
    # Matmuls read only in float32 store a float32 result (``widen``); the cotangent of a
    # free operand (a parameter) narrowed from float32 by a casting rule is accumulated in
    # float32 (``_wide``). Also for a matmul that a rule's ``bind`` declined (a float8 rule's
    # matmul too small for float8 runs in the compute dtype).
    f32_ct = _wide.narrowed(invals, new_invals, in_free) if ctx.float32_cotangents and rule.casts_only else []
    if (widen or f32_ct) and _wide.applies(prim, new_invals, params):
        return _wide.bind(prim, new_invals, params, wide=widen, arrived=invals, float32_cotangent=f32_ct)
    if (
        ctx.remat
        and bias_sum
        and (summed := _bias_into_float32(eqn, prim, invals, new_invals, in_free, ctx.compute_dtype))
    ):
        return _bind_bias_summed_apart(eqn, prim, new_invals, params, summed, ctx.compute_dtype)
    if _sums_in_transpose(eqn, new_invals):
        return _bind_through_float32(prim, new_invals, params)
    return bind_broadcast_in_float32(eqn, prim, invals, new_invals, params)


def _sums_in_transpose(eqn: Any, ops: Sequence[Any]) -> bool:
    """Whether `eqn` moves a half-precision operand so that its derivative sums: JAX
    transposes a broadcast into a `reduce_sum` over the broadcast dimensions, and a gather
    into a `scatter-add` over its indices (which may repeat), in the dtype of the operand
    as bound. In half precision those sums lose the small terms: a conditioning vector
    broadcast over 4,096 positions (3 % gradient error in bfloat16), a node's features
    gathered by 2,000 edges (80 %)."""
    x = ops[0] if ops else None
    if x is None or not _compat.is_tracer(x) or _dtype_or_none(x) not in _dtypes.HALF:
        return False
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        return int(np.prod(eqn.params["shape"], dtype=np.int64)) > int(np.size(x))
    if name == "gather":
        return not _plan.reads_each_once(eqn)
    return False


def _bind_through_float32(prim: Any, ops: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """`prim` on its half-precision operand converted to float32, the result converted
    back: the same values (data movement is exact), and a derivative that sums in float32
    (the cotangent converted to float32 first, the operand's cotangent rounded once)."""
    half = _dtypes.dtype_of(ops[0])
    outs = _cpu_matmul.bind(prim, [lax.convert_element_type(ops[0], _dtypes.FLOAT32), *ops[1:]], params)
    return [lax.convert_element_type(o, half) for o in outs]


def out_free(eqn: Any, in_free: Sequence[Any], n_outs: int) -> list[Any]:
    """The free flags of an equation's results: free (`LITERAL` if made only from
    literals) for data movement and sums of free float operands, else False."""
    floats = [f for f, d in zip(in_free, original_dtypes(eqn)) if _dtypes.is_castable(d)]
    flag: Any = False
    if (eqn.primitive.name in STRUCTURAL or eqn.primitive.name in SUMS) and all(floats):
        flag = LITERAL if floats and all(f == LITERAL for f in floats) else True
    return [flag] * n_outs


# Operations that only select, order or move their operands' values: a constant beyond
# the half-precision range saturates to its largest finite value and keeps its meaning (a
# mask's fill stays the most negative value). Others run in float32 with it.
_SELECTING = _plan.COMMUTES_WITH_ROUNDING | {"clamp", "select_n", "max", "min", "pmax", "pmin", "sort"}


def _overflowing_constant(prim: Any, invals: Sequence[Any], in_free: Sequence[Any]) -> bool:
    """Whether a harmonised operation (`x16 * 1e5`) would narrow a concrete constant that
    does not fit the half-precision dtype its computed operands arrive in: it then runs in
    float32, as traced, instead of turning the constant into an infinity."""
    if prim.name in _SELECTING:
        return False
    halves = {
        _dtypes.dtype_of(x)
        for x, f in zip(invals, in_free)
        if not f and _dtypes.is_castable(_dtype_or_none(x)) and _dtypes.dtype_of(x) != _dtypes.FLOAT32
    }
    return any(
        f
        and _dtypes.is_concrete(x)
        and _dtype_or_none(x) == _dtypes.FLOAT32
        and any(not _dtypes.fits(x, h) for h in halves)
        for x, f in zip(invals, in_free)
    )


def _traced_fills(prim: Any, invals: Sequence[Any], in_free: Sequence[Any]) -> list[int]:
    """The float32 operands whose narrowing to half precision saturates (a finite value
    beyond the half dtype's range becomes its largest finite value, not an infinity:
    `autocast._dtypes.saturating_cast`; concrete values saturate in any case): those
    that reach the equation traced (their value is not known here) and are

    - free (a function input, a closure constant, a parameter or pytree field, a literal, or
      data movement of those) and read by an operation that only selects, orders or moves
      values (`where`, `max`, `clamp`, ...): a mask fill such as `finfo(float32).min`
      held in an array keeps its meaning (the most negative value), so a fully masked row
      stays finite where float32's is; a computed activation that overflows is never
      saturated, so the overflow stays visible to a loss scaler and `find_overflow`;
    - made only from literals (a fill passed into a `jit`), for any operation.
    """
    return [
        i
        for i, (x, f) in enumerate(zip(invals, in_free))
        if f
        and (f == LITERAL or prim.name in _SELECTING)
        and _compat.is_tracer(x)
        and _dtype_or_none(x) == _dtypes.FLOAT32
    ]


def _broadcast_candidates(
    eqn: Any, prim: Any, invals: Sequence[Any], dtypes: Sequence[Any] = (_dtypes.FLOAT32,)
) -> list[int]:
    """Operands of `dtypes` (traced: they may get a gradient) that `eqn` broadcasts."""
    if prim.name not in _IMPLICIT_BROADCAST or len(eqn.outvars) != 1:
        return []
    out_shape = tuple(eqn.outvars[0].aval.shape)
    return [
        i
        for i, x in enumerate(invals)
        if _compat.is_tracer(x)
        and _dtype_or_none(x) in dtypes
        and tuple(np.shape(x)) != out_shape
        and len(np.shape(x)) in (0, len(out_shape))
    ]


def _broadcast_cast(x: Any, eqn: Any, dtype: Any) -> Any:
    out_shape = tuple(eqn.outvars[0].aval.shape)
    dims = tuple(range(len(out_shape))) if np.ndim(x) else ()
    return lax.convert_element_type(lax.broadcast_in_dim(x, out_shape, dims), dtype)


def _float32_broadcasts_ahead(eqn: Any, prim: Any, invals: Sequence[Any]) -> list[tuple[int, Any]]:
    """For an operation linear in its operands (`x16 + bias32`): the broadcast operands
    whose narrowing is predictable (the other float operands share one half dtype), with
    that dtype. The rule's cast of them then broadcasts in float32 first (no dead convert
    left behind); see `bind_broadcast_in_float32` for the rest."""
    if prim.name not in _LINEAR_BROADCAST:
        return []
    cands = _broadcast_candidates(eqn, prim, invals)
    others = {
        _dtype_or_none(x) for i, x in enumerate(invals) if i not in cands and _dtypes.is_castable(_dtype_or_none(x))
    }
    if not cands or len(others) != 1 or _dtypes.FLOAT32 in others:
        return []
    (half,) = others
    return [(i, half) for i in cands]


def bind_broadcast_in_float32(
    eqn: Any, prim: Any, invals: list[Any], new_invals: list[Any], params: dict[str, Any]
) -> list[Any]:
    """Bind, broadcasting in float32 the operands that the rule narrowed from float32 and
    that the primitive broadcasts (a bias `(1, C)` added to `(N, C)` activations), and
    those that arrive in half precision (a conditioning vector added at every position).

    Casting first and broadcasting in half precision would make the gradient of such an
    operand (JAX's transpose of the broadcast: a sum over the broadcast axes, thousands of
    terms for a bias) a half-precision reduction. Broadcast-then-cast is the same forward
    value, and its transpose is `convert` to float32 followed by `reduce_sum` in
    float32, which XLA fuses (no float32 activation-sized buffer). For a primitive that is
    not linear in the operand (`x * scale`) the broadcast is recomputed in the backward
    pass (`jax.checkpoint`) rather than saved as an activation-sized residual.
    """
    widen = [
        i
        for i in _broadcast_candidates(eqn, prim, invals, _dtypes.CASTABLE)
        if _dtypes.dtype_of(new_invals[i]) in _dtypes.CASTABLE
        and _dtypes.dtype_of(new_invals[i]) != _dtypes.FLOAT32
        and np.shape(new_invals[i]) == np.shape(invals[i])  # not already broadcast ahead
    ]
    if not widen:
        return _cpu_matmul.bind(prim, new_invals, params)

    def bind(*ops):
        ops = list(ops)
        for i in widen:
            wide = lax.convert_element_type(ops[i], _dtypes.FLOAT32)  # (a half one: summed in float32)
            ops[i] = _broadcast_cast(wide, eqn, _dtypes.dtype_of(new_invals[i]))
        return _cpu_matmul.bind(prim, ops, params)

    ops = [invals[i] if i in widen else x for i, x in enumerate(new_invals)]
    if prim.name in _LINEAR_BROADCAST:
        return bind(*ops)
    return _compat.checkpoint(bind)(*ops)


def _bias_into_float32(
    eqn: Any, prim: Any, invals: Sequence[Any], new_invals: Sequence[Any], in_free: Sequence[Any], half: Any
) -> list[int]:
    """For `x @ w + bias32` bound in float32 before an expensive elementwise function
    (GELU's `tanh`: the planner's `bias_sums`; the caller checks that): the broadcast
    float32 operands that are parameters or inputs (free, traced). See
    `_bind_bias_summed_apart`."""
    if half not in _dtypes.HALF or not eqn.outvars:
        return []
    if any(_dtype_or_none(x) != _dtypes.FLOAT32 for x in new_invals):
        return []
    return [i for i in _broadcast_candidates(eqn, prim, invals) if in_free[i] and in_free[i] != LITERAL]


def _bind_bias_summed_apart(
    eqn: Any, prim: Any, new_invals: list[Any], params: dict[str, Any], summed: Sequence[int], half: Any
) -> list[Any]:
    """Bind `x16 + bias32` in float32 with the bias broadcast first, its gradient (JAX's
    transpose of the broadcast) summed in float32 from the cotangent rounded to the half
    dtype behind an optimisation barrier (`_rounded_cotangent`).

    The values are those of the float32 sum. The bias gradient is the sum of the cotangent
    that the half operand receives anyway (`x16`'s, rounded once, as the weight gradient
    of the matmul that made `x16` reads it), in a kernel of its own. Summed from the
    float32 cotangent instead, the reduction is fused into the kernel that computes the
    island's backward pass, and XLA:GPU does not fuse an expensive float32 producer (GELU's
    recomputed `tanh`) into a reduction: the float32 `tanh` is written to memory and
    read back (issue 28; `tests/test_islands.py`)."""
    out_shape = tuple(eqn.outvars[0].aval.shape)
    ops = list(new_invals)
    for i in summed:
        full = lax.broadcast_in_dim(ops[i], out_shape, tuple(range(len(out_shape))) if np.ndim(ops[i]) else ())
        ops[i] = _rounded_cotangent(full, np.dtype(half).name)
    return _cpu_matmul.bind(prim, ops, params)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _rounded_cotangent(x: Any, half: str) -> Any:
    """The identity, whose cotangent is rounded to `half` (and converted back) behind an
    optimisation barrier: XLA cannot fuse what reads it with what made it.

    A `custom_jvp` whose tangent map is that rounding (linear to JAX: conversions and the
    barrier transpose to themselves), so reverse mode rounds the cotangent and forward mode
    (`jax.jvp`, `jax.hessian`) works too, its tangent rounded alike; a `custom_vjp` would
    refuse forward mode."""
    return x


@_rounded_cotangent.defjvp
def _rounded_cotangent_jvp(half: str, primals: tuple[Any], tangents: tuple[Any]) -> tuple[Any, Any]:
    (x,), (t,) = primals, tangents
    rounded = lax.optimization_barrier(lax.convert_element_type(t, np.dtype(half)))
    return x, lax.convert_element_type(rounded, _dtypes.dtype_of(t))


def _describe(x: Any) -> str:
    """`a tuple of 2 arrays (float16[3], float16[3])`: what a rule returned, for errors."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe_leaf(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"a {type(x).__name__} of {len(x)} ({inner})"
    return _describe_leaf(x)


def _describe_leaf(v: Any) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"array {v.dtype}{list(v.shape)}"
    return type(v).__name__


def _all_arrays(x: Sequence[Any]) -> bool:
    return all(hasattr(v, "shape") and hasattr(v, "dtype") for v in x)


def check_rule_result(result: Any, prim: Any, rule: Any, invals: Sequence[Any], orig: Sequence[Any]):
    where = f"rule {rule_name(rule)} for primitive '{prim.name}'"
    expected = (
        "expected the pair (operands, params): the operands as a list or tuple, one per operand in order, "
        "and the params as a dict (unchanged: the **params the rule was called with)"
    )
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    if not pair or not isinstance(result[0], (tuple, list)) or not isinstance(result[1], Mapping):
        lone = isinstance(result, (tuple, list)) and bool(result) and _all_arrays(result)
        hint = " (it looks like the operands alone)" if lone else ""
        raise TypeError(f"{where} returned {_describe(result)}{hint}; {expected}.")
    new_invals, params = result
    new_invals = list(new_invals)
    if len(new_invals) != len(invals):
        raise ValueError(
            f"{where} returned {len(new_invals)} operands; expected {len(invals)} (one per operand, in order)."
        )
    params = dict(params)
    for i, (new, old, o) in enumerate(zip(new_invals, invals, orig)):
        new_dt, old_dt = _dtype_or_none(new), _dtype_or_none(old)
        if _dtypes.is_castable(o):
            if new_dt is None or not _dtypes.is_floating(new_dt):
                raise TypeError(
                    f"{where} returned dtype {new_dt} for operand {i}, a floating operand "
                    f"(traced as {np.dtype(o).name}); expected a floating dtype such as float16, bfloat16 or float32."
                )
        elif new_dt != old_dt:
            raise TypeError(
                f"{where} changed operand {i} from {old_dt} to {new_dt}; only float16/bfloat16/float32 "
                f"operands may be cast (integers, booleans, keys, float64 and complex never are)."
            )
    return new_invals, params


def _dtype_or_none(x: Any) -> Any:
    dt = getattr(x, "dtype", None)
    if dt is None:
        try:
            return np.result_type(x)
        except TypeError:
            return None
    return dt
