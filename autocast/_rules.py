"""Casting rules: what an equation's operands are cast to before it is bound.

A rule has the protocol of jaxamp (which autocast keeps, so jaxamp rules work unchanged)::

    rule(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)

``compute_dtype`` is the half-precision dtype given to :func:`autocast.amp`;
``original_dtypes`` are the dtypes the operands had when the function was traced (all
float32 for a float32 model); ``invars`` are the operands as they arrive now (some may
already be in half precision); ``bind_params`` are the primitive's parameters. A rule
returns the operands to bind with and the parameters; it must return as many operands as
it got, may change only float16/bfloat16/float32 operands, and only to a floating dtype.

Rules never change integers, booleans, PRNG keys, float64 or complex values: the helpers
here skip them.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat, _dtypes, _fp8

Rule = Callable[..., tuple[Sequence[Any], dict[str, Any]]]

# Which operands of the equation being ruled on are "free": function inputs, constants and
# literals, or values only reshaped/broadcast/sliced from them (not computed). The
# interpreter sets it around each rule call; ``use_input_precision`` reads it so that a
# parameter or a scalar constant adapts to a half-precision activation instead of dragging
# it up to float32. User rules can ignore it.
_free_mask: contextvars.ContextVar[Sequence[bool] | None] = contextvars.ContextVar("free_mask", default=None)


def _castable_pairs(original_dtypes: Sequence[Any], invars: Sequence[Any]) -> list[int]:
    return [
        i
        for i, (orig, x) in enumerate(zip(original_dtypes, invars))
        if _dtypes.is_castable(orig) and _dtypes.is_castable(_dtypes.dtype_of(x))
    ]


def _cast_all(invars: Sequence[Any], indices: Sequence[int], dtype: Any) -> list[Any]:
    out = list(invars)
    for i in indices:
        out[i] = _dtypes.cast(out[i], dtype)
    return out


def _with_preferred(params: dict[str, Any], dtype: Any) -> dict[str, Any]:
    pref = params.get("preferred_element_type")
    if pref is not None and _dtypes.is_castable(pref):
        return dict(params, preferred_element_type=np.dtype(dtype))
    return params


def use_compute_precision(compute_dtype, original_dtypes, *invars, **params):
    """Float operands in the compute dtype (matmuls, convolutions).

    A ``preferred_element_type`` becomes the compute dtype too, so the result is stored in
    half precision (XLA still accumulates in float32 on GPUs and TPUs).

    **Returns:** the operands to bind with and the parameters (the rule protocol, see
    [Policies and rules](../policies.md)).

    Example::

        policy = autocast.extend_policy({jax.lax.cumsum_p: autocast.use_compute_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    idx = _castable_pairs(original_dtypes, invars)
    return _cast_all(invars, idx, compute_dtype), _with_preferred(params, compute_dtype)


def is_compute_rule(rule: Any) -> bool:
    """Whether ``rule`` runs its equation in the compute dtype the way
    :func:`use_compute_precision` does (a matmul in half precision): the planner then treats
    the equation as a half-precision consumer of its operands and a producer of a
    half-precision result. A rule opts in with the attribute ``compute_like = True``."""
    return rule is use_compute_precision or getattr(rule, "compute_like", False) is True


def casts_only(rule: Any) -> bool:
    """Whether ``rule`` changes its operands only by casting them (so a narrowed operand is
    ``operand.astype(dtype)``): :func:`use_compute_precision`, :func:`use_precision` rules,
    and rules with the attribute ``casts_only = True``."""
    return rule is use_compute_precision or getattr(rule, "casts_only", False) is True


# A rule may also carry ``binder(ctx, eqn, arrived, cast, params) -> outputs | None``: the
# interpreter then calls it instead of binding the primitive on the cast operands
# (``arrived``: the operands before the rule; ``cast``: what the rule returned). It returns
# the equation's outputs, or None to have the equation bound as usual.


def use_float32_precision(compute_dtype, original_dtypes, *invars, **params):
    """Float operands in float32; the result stays float32 (exp/log, reductions, ...).

    **Returns:** the operands to bind with and the parameters (the rule protocol).

    Example::

        policy = autocast.extend_policy({jax.lax.tanh_p: autocast.use_float32_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    idx = _castable_pairs(original_dtypes, invars)
    return _cast_all(invars, idx, _dtypes.FLOAT32), _with_preferred(params, _dtypes.FLOAT32)


def select_in_float32(compute_dtype, original_dtypes, *invars, **params):
    """The planner's float32 rule for a slice or a gather that reads each element of its
    operand at most once and whose every reader computes in float32 (the label logit of a
    cross-entropy); not a policy category. Its ``binder`` takes a
    half-precision operand through a custom JVP: the result is selected from the operand's
    float32 conversion (the very value the other float32 readers of the operand convert to,
    so XLA's excess precision cannot give the two paths different roundings), but the
    tangent is selected in half precision and converted after, so the backward pass
    scatters a half-precision cotangent, of the operand's size, that XLA folds into the
    operand's other cotangents, instead of a float32 one. The rule itself leaves the operand
    as it arrives (the binder converts it); a float32 operand is selected as it is."""
    return list(invars), params


def _bind_select_in_float32(ctx, eqn, arrived, cast, params):
    x = arrived[0]
    if not _dtypes.is_castable(_dtypes.dtype_of(x)) or _dtypes.dtype_of(x) == _dtypes.FLOAT32:
        return None  # selected as it is
    bind = functools.partial(_compat.bind, eqn.primitive, params=params)

    def select(x, *rest):
        return bind([_dtypes.cast(x, _dtypes.FLOAT32), *rest])[0]

    select.__name__ = select.__qualname__ = f"{eqn.primitive.name}_in_float32"  # names the call in jaxprs
    select = jax.custom_jvp(select)

    @select.defjvp
    def _select_jvp(primals, tangents):
        return select(*primals), _dtypes.cast(bind([tangents[0], *primals[1:]])[0], _dtypes.FLOAT32)

    return [select(x, *cast[1:])]


select_in_float32.binder = _bind_select_in_float32  # type: ignore[attr-defined]


def use_original_precision(compute_dtype, original_dtypes, *invars, **params):
    """Every operand back in the dtype it had when the function was traced.

    **Returns:** the operands to bind with and the parameters (the rule protocol).

    Example::

        policy = autocast.extend_policy({"head": autocast.use_original_precision})  # a named scope
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    out = list(invars)
    for i in _castable_pairs(original_dtypes, invars):
        out[i] = _dtypes.cast(out[i], original_dtypes[i])
    return out, params


def use_widest_precision(compute_dtype, original_dtypes, *invars, **params):
    """Mixed float operands promoted to the widest of their current dtypes.

    **Returns:** the operands to bind with and the parameters (the rule protocol).

    Example::

        policy = autocast.extend_policy({jax.lax.add_p: autocast.use_widest_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    idx = _castable_pairs(original_dtypes, invars)
    if not idx:
        return list(invars), params
    target = _dtypes.widest(_dtypes.dtype_of(invars[i]) for i in idx)
    return _cast_all(invars, idx, target), params


def use_input_precision(compute_dtype, original_dtypes, *invars, **params):
    """Run in the dtype the operands arrive in; mixed float operands are harmonised.

    Operands that were computed decide: if they all arrive in one dtype, that dtype is
    used and free operands (parameters, inputs, constants, and values only reshaped or
    broadcast from them) are cast to it, so ``x16 + bias32`` and ``x16 * 0.5`` stay in half
    precision. Computed operands of different dtypes are promoted to the widest, so a
    float32 statistic is never rounded to half precision (``x16 - mean32`` runs in float32).

    **Returns:** the operands to bind with and the parameters (the rule protocol).

    Example::

        policy = autocast.extend_policy({jax.lax.exp_p: autocast.use_input_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    idx = _castable_pairs(original_dtypes, invars)
    if len(idx) < 2:
        return list(invars), params
    free = _free_mask.get()
    computed = [i for i in idx if free is None or not free[i]]
    deciders = computed or idx
    target = _dtypes.widest(_dtypes.dtype_of(invars[i]) for i in deciders)
    return _cast_all(invars, idx, target), params


def use_as_is(compute_dtype, original_dtypes, *invars, **params):
    """No casting at all (operands of independent dtypes: sort keys and values, barriers).

    **Returns:** the operands unchanged and the parameters (the rule protocol).

    Example::

        policy = autocast.extend_policy({jax.lax.sort_p: autocast.use_as_is})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    return list(invars), params


def use_precision(dtype: Any) -> Rule:
    """A rule that casts the float operands to ``dtype`` (float16, bfloat16 or float32).

    **Arguments:** `dtype`: float16, bfloat16 or float32 (a dtype or its name).

    **Returns:** a rule with the rule protocol.

    Example::

        policy = autocast.extend_policy({"rms_norm": autocast.use_precision(jnp.float32)})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
    """
    target = _dtypes.canonical_compute_dtype(dtype, argument="dtype")

    def rule(compute_dtype, original_dtypes, *invars, **params):
        idx = _castable_pairs(original_dtypes, invars)
        return _cast_all(invars, idx, target), _with_preferred(params, target)

    rule.__name__ = rule.__qualname__ = f"use_precision({target.name})"
    rule.casts_only = True  # type: ignore[attr-defined]
    return rule


def convert_element_type_rule(compute_dtype, original_dtypes, *invars, **params):
    """``astype``: a float32 -> float32 conversion (weak type to strong type) follows its
    input's current dtype; an explicit cast to another dtype is kept."""
    (x,) = invars
    new = params.get("new_dtype")
    orig = original_dtypes[0]
    cur = _dtypes.dtype_of(x)
    if _dtypes.is_castable(orig) and _dtypes.is_castable(cur) and new is not None and np.dtype(new) == np.dtype(orig):
        params = dict(params, new_dtype=cur)
    return [x], params


CATEGORIES: dict[str, Rule] = {
    "compute": use_compute_precision,
    "float32": use_float32_precision,
    "input": use_input_precision,
    "widest": use_widest_precision,
    "original": use_original_precision,
    "as_is": use_as_is,
    "convert": convert_element_type_rule,
}
"""The rule each category name of a policy file stands for."""

# float8 matmuls (``policies/fp8.toml``): rules with ``compute_like`` and a ``binder``.
CATEGORIES.update(_fp8.install(use_compute_precision, _free_mask))
