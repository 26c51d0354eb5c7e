"""jmp's loss scales as Equinox modules (see `autocast.compat.jmp`).

The pytree structure comes from the fields (array leaves: the scale and the counter;
everything else static), so nothing is lost when a state is flattened and rebuilt.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, TypeVar, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _loss_scale

T = TypeVar("T")


def _flag(pred: Any, where: str) -> jax.Array:
    """A scalar boolean array; jmp's AssertionError (with the reason) otherwise."""
    flag = jnp.asarray(pred)
    if flag.ndim != 0 or flag.dtype != jnp.bool_:
        raise AssertionError(
            f"{where}: expected boolean scalar (e.g. the output of all_finite); got shape "
            f"{flag.shape} and dtype {flag.dtype}."
        )
    return flag


def _rescale(tree: T, scale: Any, *, divide: bool) -> T:
    """Multiply (or divide) every floating leaf by `scale` in float32 or wider.

    Scaling returns float32 (a float16 loss times 2**15 does not overflow); unscaling
    casts each leaf back to its own dtype. Integer and non-array leaves are left alone.
    """

    def leaf(x: Any) -> Any:
        if not _loss_scale._is_inexact_leaf(x):
            return x
        x = jnp.asarray(x)
        wide = _loss_scale._compute_dtype(x.dtype)
        s = jnp.asarray(scale).astype(wide)
        return (x.astype(wide) / s).astype(x.dtype) if divide else x.astype(wide) * s

    return jax.tree.map(leaf, tree)


def _static_number(cls: str, name: str, value: Any, *, low: float, integral: bool = False) -> float:
    try:
        number = float(np.asarray(value))
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        raise TypeError(
            f"{cls}: `{name}` is static configuration and must be a concrete number; got {name}={value!r}."
        ) from None
    if np.ndim(value) != 0 or not math.isfinite(number) or number < low or (integral and number != int(number)):
        kind = "an integer" if integral else "a finite number"
        raise ValueError(f"{cls}: `{name}` must be {kind} >= {low:g}; got {name}={value!r}.")
    return number


def _warn_if_not_floating(x: Any, name: str) -> None:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        warnings.warn(f"Expected floating type for {name}, got {dtype}", stacklevel=3)


class NoOpLossScale(eqx.Module):
    """No loss scaling: `scale` and `unscale` return their input, `loss_scale` is 1.

    Example:
        ```python
        loss_scale = jmp.NoOpLossScale()  # for bfloat16 or float32 training
        assert loss_scale.scale(params) is params and loss_scale.loss_scale == 1
        ```
    """

    @property
    def loss_scale(self) -> int:
        return 1

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """`self`: the (absent) scale never changes."""
        del grads_finite
        return self


class StaticLossScale(eqx.Module):
    """A fixed loss scale (static configuration: the module has no array leaves).

    `scale` multiplies the floating leaves in float32; `unscale` divides in float32
    and casts each leaf back to its dtype.

    Args:
        loss_scale: A concrete non-negative number, e.g. `2.0**15`.

    Raises:
        TypeError: `loss_scale` is not a concrete number.
        ValueError: `loss_scale` is negative, not finite or not a scalar.

    Example:
        ```python
        loss_scale = jmp.StaticLossScale(2.0**15)
        grads = loss_scale.unscale(jax.grad(lambda p: loss_scale.scale(loss(p)))(params))
        assert loss_scale.adjust(jmp.all_finite(grads)) is loss_scale
        ```
    """

    loss_scale: float = eqx.field(static=True)

    def __init__(self, loss_scale: Any):
        self.loss_scale = _static_number("StaticLossScale", "loss_scale", loss_scale, low=0.0)

    def scale(self, tree: T) -> T:
        return _rescale(tree, self.loss_scale, divide=False)

    def unscale(self, tree: T) -> T:
        return _rescale(tree, self.loss_scale, divide=True)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """`self`: the scale never changes."""
        del grads_finite
        return self


class DynamicLossScale(eqx.Module):
    """jmp's dynamic loss scale as an Equinox module.

    Args:
        loss_scale: The initial scale; stored as a float32 array leaf whatever its dtype.
        counter: Finite steps since the last change (int32 array leaf, default 0).
        period: Grow the scale after this many consecutive finite steps (static, >= 1).
        factor: Multiply the scale by it on growth, divide on a non-finite step
            (static, >= 1).
        min_loss_scale: The scale never drops below it (static, default 1).

    Raises:
        ValueError: `loss_scale` is not a scalar, `period` is not an integer >= 1,
            `factor` is below 1, or `min_loss_scale` is negative (or not finite).
        TypeError: `counter` is not an integer scalar, or `period`, `factor` or
            `min_loss_scale` is not a concrete number.

    `adjust(grads_finite)`: on a finite step the counter grows and after `period` of
    them the scale is multiplied by `factor` (unless that overflows); on a non-finite
    step the scale is divided by `factor` (not below `min_loss_scale`) and the counter
    resets. A `grads_finite` that is not a boolean scalar raises `AssertionError`, as
    in jmp.

    Example:
        ```python
        import autocast.compat.jmp as jmp

        loss_scale = jmp.DynamicLossScale(jnp.float32(2**15))
        grads = loss_scale.unscale(jax.grad(lambda p: loss_scale.scale(loss(p)))(params))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        new_params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        params = jmp.select_tree(finite, new_params, params)
        ```
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: int = eqx.field(static=True)
    factor: float = eqx.field(static=True)
    min_loss_scale: float = eqx.field(static=True)

    def __init__(
        self,
        loss_scale: Any,
        counter: Any = None,
        period: int = 2000,
        factor: float = 2,
        min_loss_scale: Any = None,
    ):
        cls = "DynamicLossScale"
        _warn_if_not_floating(loss_scale, "loss_scale")
        if min_loss_scale is None:
            min_loss_scale = 1.0
        else:
            _warn_if_not_floating(min_loss_scale, "min_loss_scale")
        if np.ndim(loss_scale) != 0:
            raise ValueError(f"{cls}: `loss_scale` must be a scalar; got shape {np.shape(loss_scale)}.")
        self.loss_scale = jnp.asarray(loss_scale, jnp.float32)
        counter = jnp.zeros((), jnp.int32) if counter is None else jnp.asarray(counter)
        if counter.ndim != 0 or not jnp.issubdtype(counter.dtype, jnp.integer):
            raise TypeError(
                f"{cls}: `counter` must be an integer scalar; got shape {counter.shape} and dtype {counter.dtype}."
            )
        self.counter = counter.astype(jnp.int32)
        self.period = int(_static_number(cls, "period", period, low=1, integral=True))
        self.factor = _static_number(cls, "factor", factor, low=1)
        self.min_loss_scale = _static_number(cls, "min_loss_scale", min_loss_scale, low=0.0)

    def scale(self, tree: T) -> T:
        """Multiply the floating leaves by the scale, in float32."""
        return _rescale(tree, self.loss_scale, divide=False)

    def unscale(self, tree: T) -> T:
        """Divide the floating leaves by the scale in float32; each keeps its dtype."""
        return _rescale(tree, self.loss_scale, divide=True)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next state after a step whose gradients were (not) finite."""
        finite = _flag(grads_finite, "DynamicLossScale.adjust")
        grow = self.counter + 1 >= self.period
        grown = self.loss_scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        shrunk = jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale)
        loss_scale = jnp.where(finite, jnp.where(grow, grown, self.loss_scale), shrunk)
        counter = jnp.where(finite & ~grow, self.counter + 1, 0)
        return eqx.tree_at(
            lambda s: (s.loss_scale, s.counter), self, (loss_scale.astype(jnp.float32), counter.astype(jnp.int32))
        )


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007 (a runtime alias, as in jmp)


def all_finite(tree: Any, *, axis_name: Any = None) -> jax.Array:
    """Whether every floating leaf of `tree` is free of inf and NaN (a scalar bool array).

    Args:
        tree: Any pytree; integer and non-array leaves are ignored.
        axis_name: Under `pmap`/`shard_map`, agree across this mapped axis (an
            addition to jmp's API).

    Returns:
        A scalar boolean array; True for a tree without floating leaves.

    Example:
        ```python
        assert not jmp.all_finite({"w": jnp.array([1.0, jnp.inf])})
        ```
    """
    return _loss_scale.all_finite(tree, axis_name=axis_name)


def select_tree(pred: Any, a: T, b: T) -> T:
    """`a` where `pred` else `b`, leaf by leaf (bit-identical to the chosen input).

    Args:
        pred: A scalar boolean, e.g. `all_finite(grads)`.
        a: The pytree chosen where `pred` is True. Its non-array leaves (an Equinox
            module's activation function) are taken in either case.
        b: A pytree with the structure of `a`; matching array leaves have the same shape
            and dtype.

    Raises:
        AssertionError: `pred` is not a boolean scalar (as in jmp).
        TypeError: Matching array leaves differ in shape or dtype.

    Example:
        ```python
        new_params = jax.tree.map(lambda p: p - 0.1, params)
        kept = jmp.select_tree(jnp.array(False), new_params, params)
        assert (kept["w1"] == params["w1"]).all()
        ```
    """
    flag = _flag(pred, "select_tree")
    return _loss_scale.select_tree(flag, a, b)
