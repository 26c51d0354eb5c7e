"""MPX-compatible loss scaling and gradient wrappers (see `autocast.compat.mpx`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._amp import amp
from .._loss_scale import _as_flag, _concrete, _multiply
from .._loss_scale import all_finite as _all_finite
from .._loss_scale import select_tree as _select_tree
from .._optim import optimizer_update as _optimizer_update
from .._scaled_grad import _value_and_grads
from ._mpx_cast import _resolve_half, cast_to_full_precision, cast_tree


def _scale_array(name: str, value: Any) -> jax.Array:
    array = jnp.asarray(value, dtype=jnp.float32)
    if array.size != 1 or array.ndim > 1:
        raise ValueError(f"DynamicLossScaling: `{name}` must be a scalar (shape () or (1,)); got shape {array.shape}.")
    concrete = _concrete(array)
    if concrete is not None and not np.all(concrete > 0):
        raise ValueError(f"DynamicLossScaling: `{name}` must be a positive number; got {concrete}.")
    return array


@jax.jit
def _adjust(loss_scaling, min_loss_scaling, counter, factor, period, finite, max_value):
    grown = loss_scaling * factor
    grown = jnp.where(jnp.all(jnp.isfinite(grown)), grown, loss_scaling)
    on_finite = jnp.where(counter == period - 1, grown, loss_scaling)
    on_overflow = jnp.maximum(min_loss_scaling, loss_scaling / factor)
    new = jnp.clip(jnp.where(finite, on_finite, on_overflow), min_loss_scaling, max_value)
    new_counter = jnp.where(finite, (counter + 1) % period, 0)
    return new.astype(loss_scaling.dtype), new_counter.astype(counter.dtype)


class DynamicLossScaling(eqx.Module):
    """MPX's dynamic loss scale (jmp's algorithm) as an immutable pytree.

    On `adjust(True)` the counter advances and every `period`-th finite step the scale
    grows by `factor` (unless that overflows float32); on `adjust(False)` the scale is
    divided by `factor` (not below `min_loss_scaling`) and the counter resets. The scale
    is clipped to `[min_loss_scaling, max of the half dtype]`.

    Fixes of MPX 0.1.8:

    - `scale` multiplies in float32 (or wider): MPX multiplies by a float16 copy of the
      scale, so a float16 loss of 3 times a scale of `2**15` is `inf`.
    - The upper clip is the largest value of `half_dtype` (65504 for float16, about
      3.4e38 for bfloat16); MPX clips at the float16 maximum whatever is configured.
    - A shape-`(1,)` scale (older MPX releases and MPX's own tests) is accepted; the
      state keeps that shape. Python numbers are accepted and stored as float32.

    Args:
        loss_scaling: The initial scale, e.g. `mpx.FLOAT16_MAX`.
        min_loss_scaling: The lower bound, e.g. `jnp.ones(())`.
        factor: Growth and backoff factor (default 2).
        period: Finite steps between growths (default 2000).
        counter: Finite steps since the last change (default 0).
        half_dtype: The dtype whose maximum bounds the scale (static; an autocast
            extension); default: the configured half-precision dtype when the state is
            created.

    Raises:
        ValueError: `loss_scaling` or `min_loss_scaling` is not a positive scalar,
            `factor` is not > 1, `period` is below 1, or `half_dtype` names no
            half-precision dtype.
        TypeError: `half_dtype` is not a half-precision dtype.

    Example:
        ```python
        scaling = mpx.DynamicLossScaling(loss_scaling=mpx.FLOAT16_MAX,
                                         min_loss_scaling=jnp.ones(()), period=2000)
        ```
    """

    loss_scaling: jax.Array
    min_loss_scaling: jax.Array
    counter: jax.Array
    factor: int
    period: int
    half_dtype: Any = eqx.field(static=True)

    def __init__(
        self,
        loss_scaling: Any,
        min_loss_scaling: Any,
        factor: int = 2,
        period: int = 2000,
        counter: Any = None,
        *,
        half_dtype: Any = None,
    ):
        self.loss_scaling = _scale_array("loss_scaling", loss_scaling)
        self.min_loss_scaling = _scale_array("min_loss_scaling", min_loss_scaling)
        if isinstance(factor, (int, float)) and not factor > 1:
            raise ValueError(f"DynamicLossScaling: `factor` must be > 1; got {factor!r}.")
        if isinstance(period, (int, np.integer)) and period < 1:
            raise ValueError(f"DynamicLossScaling: `period` must be a positive integer; got {period!r}.")
        self.factor = factor
        self.period = period
        if counter is None:
            counter = jnp.zeros(self.loss_scaling.shape, jnp.int32)
        self.counter = jnp.asarray(counter)
        self.half_dtype = _resolve_half(half_dtype)

    def _scalar(self) -> jax.Array:
        return self.loss_scaling.reshape(())

    def scale(self, tree: Any) -> Any:
        """Multiply every floating leaf of `tree` by the scale, in float32 (or wider)."""
        return _multiply(tree, self._scalar(), keep_dtype=False)

    def unscale(self, tree: Any) -> Any:
        """Multiply every floating leaf by `1 / scale` in float32 (or wider); the result
        is float32 for float16/bfloat16/float32 leaves, as in MPX."""
        return _multiply(tree, 1 / self._scalar(), keep_dtype=False)

    def adjust(self, grads_finite: Any) -> DynamicLossScaling:
        """The next state, given whether this step's gradients were finite (a scalar bool)."""
        finite = _as_flag(grads_finite, "DynamicLossScaling.adjust: `grads_finite`")
        loss_scaling, counter = _adjust(
            self.loss_scaling,
            self.min_loss_scaling,
            self.counter,
            self.factor,
            self.period,
            finite,
            jnp.float32(jnp.finfo(self.half_dtype).max),
        )
        return DynamicLossScaling(
            loss_scaling, self.min_loss_scaling, self.factor, self.period, counter, half_dtype=self.half_dtype
        )


def all_finite(tree: Any) -> jax.Array:
    """Scalar bool: no inf/NaN in any floating leaf of `tree` (True for an empty tree).

    Python floats count; non-array leaves such as functions are ignored (MPX fails on
    them).

    Args:
        tree: Any pytree.

    Returns:
        A scalar boolean array.

    Example:
        ```python
        assert not mpx.all_finite({"g": jnp.array([1.0, jnp.inf])})
        assert not mpx.all_finite({"g": float("nan"), "act": jax.nn.relu})
        ```
    """
    return _all_finite(jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, (float, complex)) else x, tree))


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """Leafwise `a if pred else b` for a scalar bool `pred`; non-array leaves come from `a`.

    Args:
        pred: A scalar bool.
        a: The pytree chosen where `pred` is True.
        b: A pytree with the structure of `a` (matching array leaves: same shape and
            dtype).

    Returns:
        `a` where `pred`, else `b`, leaf by leaf.

    Raises:
        TypeError: `pred` is not boolean, or matching array leaves differ in shape or dtype.
        ValueError: `pred` is not a scalar.

    Example:
        ```python
        zeros = jax.tree.map(jnp.zeros_like, params)
        kept = mpx.select_tree(jnp.bool_(False), zeros, params)
        assert (kept["w1"] == params["w1"]).all()
        ```
    """
    return _select_tree(pred, a, b)


def optimizer_update(
    model: Any,
    optimizer: optax.GradientTransformation,
    optimizer_state: Any,
    grads: Any,
    grads_finite: Any,
) -> tuple[Any, Any]:
    """One optax step if `grads_finite`; otherwise `(model, optimizer_state)` unchanged.

    Args:
        model: A pytree of parameters or an Equinox module.
        optimizer: An `optax.GradientTransformation`.
        optimizer_state: Its state.
        grads: Gradients with the structure of the model's inexact arrays.
        grads_finite: A scalar bool.

    Returns:
        `(model, optimizer_state)`. See `autocast.optimizer_update`.

    Example:
        ```python
        grads = jax.grad(loss_fn)(params, batch)
        new_params, new_state = mpx.optimizer_update(params, optim, opt_state, grads, jnp.bool_(False))
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), new_params, params)))
        ```
    """
    return _optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)


def scaled(func: Callable, scaling: DynamicLossScaling, has_aux: bool = False) -> Callable:
    """`func` with its value (the first output if `has_aux`) multiplied by the scale, in
    float32 (or wider).

    Args:
        func: The function.
        scaling: A `DynamicLossScaling`.
        has_aux: Whether `func` returns `(value, aux)`; only the value is scaled.

    Returns:
        The wrapped function.

    Example:
        ```python
        scaling = mpx.DynamicLossScaling(jnp.float32(2**10), jnp.float32(1.0))
        scaled_loss = mpx.scaled(loss_fn, scaling)(params, batch)
        assert float(scaled_loss) == float(loss_fn(params, batch)) * 2**10
        ```
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = func(*args, **kwargs)
        if has_aux:
            return scaling.scale(out[0]), out[1]
        return scaling.scale(out)

    return wrapper


def _half_inputs(half: Any, automatic: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """MPX casts every argument to half; with `automatic`, `amp` decides per primitive."""
    return (args, kwargs) if automatic else cast_tree((args, kwargs), half)


def _maybe_amp(func: Callable, half: Any, automatic: bool) -> Callable:
    return amp(func, compute_dtype=half) if automatic else func


def calculate_scaled_grad(
    func: Callable,
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
    *,
    half_dtype: Any = None,
    automatic: bool = False,
) -> Callable:
    """`equinox.filter_value_and_grad` of the scaled `func` on half-precision arguments.

    Returns what MPX returns: the *scaled* value (and aux) and the *scaled* gradients,
    neither unscaled nor checked. The value is scaled in float32.

    Args:
        func: Returns a scalar loss (or `(loss, aux)` with `has_aux=True`).
        scaling: A `DynamicLossScaling`.
        has_aux: Whether `func` returns `(loss, aux)`.
        use_mixed_precision: `False` gives plain `equinox.filter_value_and_grad` with
            no casting and no scaling (as in MPX).
        half_dtype: `float16`/`bfloat16` (an autocast extension); default: the
            configured dtype, read when `calculate_scaled_grad` is called.
        automatic: Do not cast the arguments; run `func` under `autocast.amp` with
            per-primitive rules instead (an autocast extension).

    Returns:
        A function returning `(scaled value, scaled grads)`, or
            `((scaled value, aux), scaled grads)` with `has_aux`.

    Example:
        ```python
        def loss_and_aux(params, batch):
            return loss_fn(params, batch), None

        scaling = mpx.DynamicLossScaling(jnp.float32(2**10), jnp.float32(1.0))
        (scaled_loss, aux), scaled_grads = mpx.calculate_scaled_grad(loss_and_aux, scaling, has_aux=True)(params, batch)
        ```
    """
    half = _resolve_half(half_dtype)
    fn = _maybe_amp(func, half, automatic)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not use_mixed_precision:
            return eqx.filter_value_and_grad(func, has_aux=has_aux)(*args, **kwargs)
        args, kwargs = _half_inputs(half, automatic, args, kwargs)
        return eqx.filter_value_and_grad(scaled(fn, scaling, has_aux), has_aux=has_aux)(*args, **kwargs)

    return wrapper


def _mixed(
    name: str, fn: Callable, scaling: Any, has_aux: bool, half: Any, automatic: bool, args: tuple, kwargs: dict
) -> tuple[jax.Array, Any, DynamicLossScaling, jax.Array, Any]:
    """(value, aux, new scaling, finite, grads): grads unscaled with the scale the loss
    was multiplied by, *then* the scale is adjusted (MPX unscales with the adjusted one)."""
    if not isinstance(scaling, DynamicLossScaling):
        raise TypeError(f"{name}: `scaling` must be an mpx.DynamicLossScaling; got {type(scaling).__name__}.")
    args, kwargs = _half_inputs(half, automatic, args, kwargs)
    loss, aux, grads = _value_and_grads(
        name, fn, cast(Any, scaling), args, kwargs, has_aux=has_aux, filter=True, argnums=0
    )
    finite = _all_finite(grads)
    return cast_to_full_precision(loss), aux, scaling.adjust(finite), finite, grads


def filter_grad(
    func: Callable,
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
    *,
    half_dtype: Any = None,
    automatic: bool = False,
) -> Callable:
    """Mixed-precision, loss-scaled `equinox.filter_grad` (gradient w.r.t. the first argument).

    The returned function casts every floating argument to the half dtype, multiplies
    the loss by the scale in float32, differentiates, unscales the gradients (float32)
    with the scale the loss was multiplied by, checks them and adjusts the scale.

    Args:
        func: Returns a scalar loss (or `(loss, aux)` with `has_aux=True`).
        scaling: A `DynamicLossScaling`.
        has_aux: Whether `func` returns `(loss, aux)`.
        use_mixed_precision: `False` gives plain `equinox.filter_grad` with
            `grads_finite=True` and `scaling` unchanged (as in MPX).
        half_dtype: `float16`/`bfloat16` (an autocast extension); default: the
            configured dtype, read when `filter_grad` is called.
        automatic: Do not cast the arguments; run `func` under `autocast.amp` with
            per-primitive rules instead (an autocast extension).

    Returns:
        A function returning `(scaling, grads_finite, grads)` or, with
            `has_aux`, `(scaling, grads_finite, grads, aux)`. The order differs from
            `filter_value_and_grad` (value first, then scaling): kept for MPX compatibility.

    Raises:
        TypeError: When the function is called: `scaling` is not a `DynamicLossScaling`,
            or `func` does not return a scalar floating-point loss.

    Example:
        ```python
        scaling = mpx.DynamicLossScaling(jnp.float32(2**10), jnp.float32(1.0))
        scaling, finite, grads = mpx.filter_grad(loss_fn, scaling)(params, batch)
        assert bool(finite) and grads["w1"].dtype == jnp.float32
        ```
    """
    half = _resolve_half(half_dtype)
    fn = _maybe_amp(func, half, automatic)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not use_mixed_precision:
            out = eqx.filter_grad(func, has_aux=has_aux)(*args, **kwargs)
            if has_aux:
                return scaling, jnp.bool_(True), out[0], out[1]
            return scaling, jnp.bool_(True), cast_to_full_precision(out)
        _, aux, new, finite, grads = _mixed("filter_grad", fn, scaling, has_aux, half, automatic, args, kwargs)
        return (new, finite, grads, aux) if has_aux else (new, finite, grads)

    return wrapper


def filter_value_and_grad(
    func: Callable,
    scaling: DynamicLossScaling,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
    *,
    half_dtype: Any = None,
    automatic: bool = False,
) -> Callable:
    """Like `filter_grad`, and also returns the loss.

    The value is the loss `func` returned, in float32, exactly: MPX divides the scaled
    loss by the *adjusted* scale, so on a growth step it logs half the loss.

    Args:
        func: Returns a scalar loss (or `(loss, aux)` with `has_aux=True`).
        scaling: A `DynamicLossScaling`.
        has_aux: Whether `func` returns `(loss, aux)`.
        use_mixed_precision: `False` gives plain `equinox.filter_value_and_grad` with
            `grads_finite=True` and `scaling` unchanged (as in MPX).
        half_dtype: `float16`/`bfloat16` (an autocast extension); default: the
            configured dtype, read when `filter_value_and_grad` is called.
        automatic: Do not cast the arguments; run `func` under `autocast.amp` with
            per-primitive rules instead (an autocast extension).

    Returns:
        A function returning `(value, scaling, grads_finite, grads)` or, with
            `has_aux`, `((value, aux), scaling, grads_finite, grads)`.

    Raises:
        TypeError: When the function is called: `scaling` is not a `DynamicLossScaling`,
            or `func` does not return a scalar floating-point loss.

    Example:
        ```python
        def loss_and_aux(params, batch):
            return loss_fn(params, batch), None

        scaling = mpx.DynamicLossScaling(jnp.float32(2**15), jnp.float32(1.0), period=2000)
        (loss, aux), scaling, finite, grads = mpx.filter_value_and_grad(loss_and_aux, scaling=scaling, has_aux=True)(
            params, batch
        )
        params, opt_state = mpx.optimizer_update(params, optim, opt_state, grads, finite)
        ```
    """
    half = _resolve_half(half_dtype)
    fn = _maybe_amp(func, half, automatic)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not use_mixed_precision:
            value, grads = eqx.filter_value_and_grad(func, has_aux=has_aux)(*args, **kwargs)
            return value, scaling, jnp.bool_(True), grads
        value, aux, new, finite, grads = _mixed(
            "filter_value_and_grad", fn, scaling, has_aux, half, automatic, args, kwargs
        )
        return ((value, aux) if has_aux else value), new, finite, grads

    return wrapper
