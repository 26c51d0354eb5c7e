"""jaxamp 0.0.4's API on autocast: `import autocast.compat.jaxamp as jaxamp`.

Every name jaxamp exports, with jaxamp's signatures and defaults: `amp`, `amp_stop`,
`default_amp_policy` (jaxamp's table: add/sub/matmul/conv in the compute dtype;
exp/log/mul/div in float32; everything else in its traced dtype), the rules
`use_compute_precision` / `use_original_precision`, `DynamicScalerState` (jaxamp's
schedule: the scale grows on the finite step *after* `patience` finite steps),
`dynamic_scale_grad`, `dynamic_scale_value_and_grad` (`redo_on_nan=10` by default,
as in jaxamp) and `dynamic_scale_tx`.

The work is done by autocast, so this also runs on current JAX (jaxamp 0.0.4 does not),
transforms the bodies of nested `jit`/`scan`/`cond`/..., keeps the loss scale a
finite power of two within `[min_scaler, max_scaler]`, scales the loss in float32,
returns the loss value exactly and ignores NaNs in `aux`. For new code prefer
`autocast.default_amp_policy` (a per-primitive table) over jaxamp's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax import lax

from .. import _amp, _loss_scale, _rules, _scaled_grad, _scope

__version__ = "0.0.4"  # the jaxamp release whose API this module reproduces

__all__ = [
    "DynamicScalerState",
    "amp",
    "amp_stop",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "use_compute_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]

use_compute_precision = _rules.use_compute_precision
use_original_precision = _rules.use_original_precision
use_precision = _rules.use_precision
use_widest_precision = _rules.use_widest_precision

default_amp_policy: dict[Any, Any] = {
    lax.add_p: use_compute_precision,
    lax.sub_p: use_compute_precision,
    lax.dot_general_p: use_compute_precision,
    lax.conv_general_dilated_p: use_compute_precision,
    "amp_default": use_original_precision,
    "amp_stop": use_original_precision,
    lax.exp_p: use_precision(jnp.float32),
    lax.log_p: use_precision(jnp.float32),
    lax.mul_p: use_precision(jnp.float32),
    lax.div_p: use_precision(jnp.float32),
}
"""jaxamp's policy, a plain `dict` as in jaxamp (so `default_amp_policy | {...}` works)."""


def amp(
    sentinal: Callable | None = None,
    *,
    compute_dtype: Any = jnp.float16,
    amp_policy: dict = default_amp_policy,
) -> Callable:
    """jaxamp's `amp`: `autocast.amp` with jaxamp's default policy.

    Args:
        sentinal: The function (jaxamp's spelling); omit it for a decorator.
        compute_dtype: The half-precision dtype (default float16).
        amp_policy: Primitive or `jax.named_scope` name -> rule; default jaxamp's table.

    Returns:
        The function run in mixed precision (outputs in the traced dtypes).

    Example:
        ```python
        loss = jaxamp.amp(loss_fn)(params, batch)
        assert loss.dtype == jnp.float32 and jnp.allclose(loss, loss_fn(params, batch), rtol=1e-2)
        ```
    """
    return _amp.amp(sentinal, compute_dtype=compute_dtype, amp_policy=amp_policy)


def amp_stop(f: Callable | None = None) -> Any:
    """jaxamp's `amp_stop`: `autocast.amp_stop` (context manager or decorator).

    Args:
        f: A function to run with mixed precision off; without it, a context manager.

    Returns:
        `f` wrapped, or a context manager.

    Example:
        ```python
        def f(params, x):
            with jaxamp.amp_stop():
                return x @ params["w1"]

        assert jaxamp.amp(f)(params, x).dtype == jnp.float32
        ```
    """
    return _scope.amp_stop(f)


class DynamicScalerState(_loss_scale.DynamicScalerState):
    """jaxamp's `DynamicScalerState`: `autocast.DynamicScalerState` with jaxamp's
    growth schedule.

    Takes the arguments of `autocast.DynamicScalerState`: `patience`, `adjust_factor`,
    `scaler`, `count` and `total_resets` in jaxamp's order and with its defaults (2000,
    2.0, 2**15, 0, 0), plus autocast's keyword-only `backoff_factor`, `min_scaler`,
    `max_scaler` and `grads_finite`.

    As in jaxamp, a finite step with `count >= patience` grows the scale (and resets
    `count`); any other finite step increments `count`. So the scale grows every
    `patience + 1` finite steps (`autocast.DynamicScalerState`: every
    `patience`). Unlike jaxamp the state is an Equinox module with static
    configuration, scales are powers of two and stay within `[min_scaler, max_scaler]`.

    Example:
        ```python
        state = jaxamp.DynamicScalerState(scaler=2**15, patience=1)
        state = state.adjust(jnp.array(True))  # count 0 -> 1
        state = state.adjust(jnp.array(True))  # count >= patience: the scale grows
        assert float(state.scaler) == 2.0**16
        ```
    """

    def adjust(self, grads_finite: Any) -> DynamicScalerState:
        """The next state after a step whose gradients were (not) finite."""
        finite = _loss_scale._as_flag(grads_finite, "DynamicScalerState.adjust: `grads_finite`")
        grow = self.count >= self.patience
        grown = jnp.minimum(self.scaler * self.adjust_factor, self.max_scaler)
        shrunk = jnp.maximum(self.scaler / self.backoff_factor, self.min_scaler)
        scaler = jnp.where(finite, jnp.where(grow, grown, self.scaler), shrunk)
        count = jnp.where(finite & ~grow, self.count + 1, 0)
        total_resets = self.total_resets + (~finite).astype(jnp.int32)
        return eqx.tree_at(
            lambda s: (s.scaler, s.count, s.total_resets, s.grads_finite),
            self,
            (scaler.astype(jnp.float32), count.astype(jnp.int32), total_resets.astype(jnp.int32), finite),
        )


def _register_flax_serialization() -> None:
    try:
        from flax import serialization
    except ImportError:  # flax is optional
        return
    serialization.register_serialization_state(
        DynamicScalerState, _loss_scale._to_state_dict, _loss_scale._from_state_dict, override=True
    )


_register_flax_serialization()

_GRAD_OPTIONS = ("argnums", "axis_name")


def _grad_options(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(_GRAD_OPTIONS))
    if unknown:
        raise TypeError(
            f"{name}: unsupported keyword argument(s) {unknown}; allowed: has_aux, redo_on_nan, filter, {', '.join(_GRAD_OPTIONS)}."
        )
    return kwargs


def dynamic_scale_grad(
    fun: Callable, *, has_aux: bool = False, redo_on_nan: int = 0, filter: bool = True, **kwargs: Any
) -> Callable:
    """jaxamp's `dynamic_scale_grad`: `autocast.dynamic_scale_grad`.

    Args:
        fun: The loss function, returning a scalar floating-point loss (or `(loss, aux)`
            with `has_aux=True`).
        has_aux: As in `jax.grad`; NaNs in aux do not count as a failure.
        redo_on_nan: On non-finite gradients, back off and recompute at most this many
            times inside the step (default 0).
        filter: `equinox.filter_grad` if True, `jax.grad` if False.
        **kwargs: `argnums` or `axis_name` (as in `autocast.dynamic_scale_grad`); anything else
            raises `TypeError`.

    Returns:
        `g(*args, dynamic_scaler_state=state)` -> `(new_state, grads)` or
            `(new_state, (grads, aux))`.

    Example:
        ```python
        state = jaxamp.DynamicScalerState()
        state, grads = jaxamp.dynamic_scale_grad(jaxamp.amp(loss_fn))(params, batch, dynamic_scaler_state=state)
        ```
    """
    options = _grad_options("dynamic_scale_grad", kwargs)
    return _scaled_grad.dynamic_scale_grad(fun, has_aux=has_aux, redo_on_nan=redo_on_nan, filter=filter, **options)


def dynamic_scale_value_and_grad(
    fun: Callable, *, has_aux: bool = False, redo_on_nan: int = 10, filter: bool = True, **kwargs: Any
) -> Callable:
    """jaxamp's `dynamic_scale_value_and_grad`: `autocast.dynamic_scale_value_and_grad`
    with jaxamp's default `redo_on_nan=10`.

    Args:
        fun: The loss function, returning a scalar floating-point loss (or `(loss, aux)`
            with `has_aux=True`).
        has_aux: As in `jax.value_and_grad`; NaNs in aux do not count as a failure.
        redo_on_nan: On non-finite gradients, back off and recompute at most this many
            times inside the step (default 10).
        filter: `equinox.filter_value_and_grad` if True, `jax.value_and_grad` if False.
        **kwargs: `argnums` or `axis_name` (as in `autocast.dynamic_scale_value_and_grad`); anything else
            raises `TypeError`.

    Returns:
        `g(*args, dynamic_scaler_state=state)` -> `(new_state, (value, grads))`
            or `(new_state, ((value, aux), grads))`; `value` is exactly what `fun` returned.

    Example:
        ```python
        state = jaxamp.DynamicScalerState()
        grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss_fn))
        state, (loss, grads) = grad_fn(params, batch, dynamic_scaler_state=state)
        ```
    """
    options = _grad_options("dynamic_scale_value_and_grad", kwargs)
    return _scaled_grad.dynamic_scale_value_and_grad(
        fun, has_aux=has_aux, redo_on_nan=redo_on_nan, filter=filter, **options
    )


def _default_scale_fn(result: Any, state: Any) -> Any:
    if isinstance(result, (tuple, list)) and len(result) == 2:
        value, aux = result
        return state.scale(value), aux
    return state.scale(result)


def _default_unscale_fn(results: Any, state: Any) -> Any:
    return state.unscale(results)


def dynamic_scale_tx(
    transform: Callable,
    redo_on_nan: int = 0,
    unscale_fn: Callable | None = None,
    scale_fn: Callable | None = None,
    *,
    axis_name: Hashable | None = None,
) -> Callable:
    """jaxamp's `dynamic_scale_tx`: loss-scale any function transformation.

    Args:
        transform: E.g. `jax.grad` or `jax.jacrev`, called as
            `transform(scaled_fun, *args, **kwargs)`.
        redo_on_nan: Back off and recompute at most this many times on a non-finite result.
        unscale_fn: `unscale_fn(results, state)` unscales the transformation's results;
            default: every floating leaf divided by the scale (in float32, back to its
            own dtype).
        scale_fn: `scale_fn(result, state)` scales the function's result; default: the
            result (or the first element of a `(value, aux)` pair) times the scale, in
            float32.
        axis_name: Agree on the finite flag across this mapped axis.

    Returns:
        `scaled_transform(fun, *args, **kwargs)`, which returns
            `g(*f_args, dynamic_scaler_state=state, **f_kwargs)` -> `(new_state, results)`;
            every floating leaf of the unscaled `results` is checked for inf/NaN.

    Raises:
        TypeError: `transform` is not callable or `redo_on_nan` is not an int; when `g`
            is called: `dynamic_scaler_state` is missing or not a scaler state.
        ValueError: `redo_on_nan` is negative.

    Example:
        ```python
        def f(x):
            return jnp.sum(jnp.sin(x) ** 2)

        state = jaxamp.DynamicScalerState()
        state, hess = jaxamp.dynamic_scale_tx(jax.hessian)(f)(jnp.ones(3), dynamic_scaler_state=state)
        assert jnp.allclose(hess, jax.hessian(f)(jnp.ones(3)))
        ```
    """
    if not callable(transform):
        raise TypeError(f"dynamic_scale_tx: `transform` must be callable; got {type(transform).__name__}.")
    _scaled_grad._check_options("dynamic_scale_tx", False, redo_on_nan, True, 0)
    scale_fn = _default_scale_fn if scale_fn is None else scale_fn
    unscale_fn = _default_unscale_fn if unscale_fn is None else unscale_fn

    def scaled_transform(fun: Callable, *args: Any, **kwargs: Any) -> Callable:
        def scaled_fun(*f_args, _dynamic_scaler_state, **f_kwargs):
            return scale_fn(fun(*f_args, **f_kwargs), _dynamic_scaler_state)

        transformed = transform(scaled_fun, *args, **kwargs)

        def step(*f_args, dynamic_scaler_state=_scaled_grad._MISSING, **f_kwargs):
            state = _scaled_grad._check_state("dynamic_scale_tx", dynamic_scaler_state, f_args)

            def attempt(state):
                results = unscale_fn(transformed(*f_args, _dynamic_scaler_state=state, **f_kwargs), state)
                return results, _loss_scale.all_finite(results, axis_name=axis_name)

            state, results, finite = _scaled_grad.retry_while_non_finite(attempt, state, redo_on_nan)
            return state.adjust(finite), results

        return step

    return scaled_transform
