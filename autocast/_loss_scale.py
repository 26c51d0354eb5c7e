"""Loss-scaler states (dynamic, static, no-op) and the pytree helpers they rely on.

A scaler state is an immutable pytree (an `equinox.Module`): its dynamic values
(`scaler`, `count`, `total_resets`, `grads_finite`) are array leaves and its
configuration (`patience`, factors, bounds) is static, so it can be passed through
`jax.jit`, `jax.vmap`, `lax.while_loop`, donation and sharding, and checkpointed with
`pickle`, `equinox.tree_serialise_leaves` or `flax.serialization`. The pytree
structure is derived from the fields, so nothing is dropped on unflatten (unlike
jmp's hand-written `tree_flatten`, which loses `min_loss_scale`).

Sharp edges:

- Scales are float32 powers of two, so scaling and unscaling are exact (barring
  overflow/underflow). Non-power-of-two scales, factors and bounds are rejected.
- Configuration is static: states with different configurations have different
  tree structures, and a change of configuration recompiles a jitted step.
- `unscale` casts each leaf back to its own dtype. Keep master parameters in
  float32: float16 *parameters* get float16 gradients, which underflow again after
  unscaling however large the scale was.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DynamicScalerState",
    "NoOpScalerState",
    "StaticScalerState",
    "all_finite",
    "select_tree",
]

# A scale s and its reciprocal 1/s are both normal float32 numbers for
# s in [2**-126, 2**126], so `x * (1/s)` is as exact as `x / s`.
_MIN_EXPONENT = -126
_MAX_EXPONENT = 126
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------
# Validation helpers (run at construction time, on concrete values only).
# ----------------------------------------------------------------------------------


def _concrete(x: Any) -> np.ndarray | None:
    """`x` as a NumPy array, or None if it is traced (validation is then skipped)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _power_of_two_exponent(value: float) -> int | None:
    """The exponent e with value == 2**e, or None if value is not a power of two."""
    if not (math.isfinite(value) and value > 0):
        return None
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else None


def _check_power_of_two(cls: str, name: str, value: float, example: str) -> None:
    exponent = _power_of_two_exponent(value)
    if exponent is None or not _MIN_EXPONENT <= exponent <= _MAX_EXPONENT:
        raise ValueError(
            f"{cls}: `{name}` must be a positive power of two between "
            f"2**{_MIN_EXPONENT} and 2**{_MAX_EXPONENT} (e.g. {example}), so that "
            f"scaling is exact; got {name}={value!r}."
        )


def _static_float(cls: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or _concrete(value) is None:
        raise TypeError(
            f"{cls}: `{name}` is static configuration and must be a concrete Python number; got {name}={value!r}."
        )
    array = np.asarray(value)
    if array.shape != () or not np.issubdtype(array.dtype, np.number):
        raise TypeError(f"{cls}: `{name}` must be a real number; got {name}={value!r}.")
    return float(array)


def _static_factor(cls: str, name: str, value: Any) -> float:
    factor = _static_float(cls, name, value)
    if not factor > 1:
        hint = (
            " (it divides the scale; PyTorch's backoff_factor=0.5 is backoff_factor=2.0 here)"
            if name == "backoff_factor"
            else ""
        )
        raise ValueError(f"{cls}: `{name}` must be > 1{hint}; got {name}={value!r}.")
    _check_power_of_two(cls, name, factor, "2.0")
    return factor


def _static_int(cls: str, name: str, value: Any) -> int:
    array = _concrete(value)
    if isinstance(value, bool) or array is None or array.shape != () or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{cls}: `{name}` must be a concrete Python int; got {name}={value!r}.")
    result = int(array)
    if not 0 <= result <= _INT32_MAX:
        raise ValueError(f"{cls}: `{name}` must be between 0 and {_INT32_MAX}; got {name}={result}.")
    return result


def _dtype_of(value: Any) -> np.dtype:
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    if isinstance(value, float):
        return np.dtype(np.float64)
    dtype = getattr(value, "dtype", None)
    return jnp.dtype(dtype) if dtype is not None else np.asarray(value).dtype


def _scalar_leaf(cls: str, name: str, value: Any, dtype: Any) -> jax.Array:
    """`value` as a scalar array of `dtype` (bool, int32 or float32), or a clear error."""
    got = _dtype_of(value)
    is_bool = got == np.bool_
    is_int = not is_bool and jnp.issubdtype(got, jnp.integer)
    is_float = jnp.issubdtype(got, jnp.floating)
    allowed, ok = {
        jnp.bool_: ("a bool", is_bool),
        jnp.int32: ("an int", is_int),
        jnp.float32: ("a real number", is_int or is_float),
    }[dtype]
    if not ok:
        raise TypeError(f"{cls}: `{name}` must be {allowed}; got {name}={value!r} of dtype {got}.")
    if np.shape(value) != ():
        raise ValueError(
            f"{cls}: `{name}` must be a scalar; got shape {np.shape(value)} "
            f"(stack states with jax.vmap or jax.tree.map instead)."
        )
    if isinstance(value, int) and dtype is jnp.float32:
        value = float(value)
    return jnp.asarray(value, dtype)


def _check_scale_value(cls: str, scaler: jax.Array, low: float, high: float) -> None:
    value = _concrete(scaler)
    if value is None:
        return
    _check_power_of_two(cls, "scaler", float(value), "2.0**15")
    if not low <= float(value) <= high:
        raise ValueError(
            f"{cls}: `scaler` must lie within [min_scaler, max_scaler] = "
            f"[{low!r}, {high!r}]; got scaler={float(value)!r}."
        )


def _check_nonnegative(cls: str, name: str, value: jax.Array) -> None:
    concrete = _concrete(value)
    if concrete is not None and int(concrete) < 0:
        raise ValueError(f"{cls}: `{name}` must be >= 0; got {name}={int(concrete)}.")


def _as_flag(value: Any, where: str) -> jax.Array:
    """A scalar boolean array, or a clear error."""
    flag = jnp.asarray(value)
    if flag.shape != ():
        raise ValueError(f"{where} must be a scalar boolean; got shape {flag.shape}.")
    if flag.dtype != jnp.bool_:
        raise TypeError(f"{where} must be a boolean (e.g. the output of all_finite); got dtype {flag.dtype}.")
    return flag


# ----------------------------------------------------------------------------------
# Tree helpers.
# ----------------------------------------------------------------------------------


def _is_inexact_leaf(x: Any) -> bool:
    if isinstance(x, (float, complex)):
        return True
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _compute_dtype(dtype: Any) -> jnp.dtype:
    """At least float32: float16/bfloat16/float8 widen, float32/64 and complex stay."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return dtype


def _multiply(tree: Any, factor: jax.Array, *, keep_dtype: bool) -> Any:
    def leaf(x):
        if not _is_inexact_leaf(x):
            return x
        x = jnp.asarray(x)
        wide = _compute_dtype(x.dtype)
        y = x.astype(wide) * factor.astype(wide)
        return y.astype(x.dtype) if keep_dtype else y

    return jax.tree.map(leaf, tree)


def all_finite(tree: Any, *, axis_name: Any = None) -> jax.Array:
    """Whether every floating (or complex) array leaf of `tree` is free of inf/NaN.

    Args:
        tree: Any pytree. Integer/boolean arrays and non-array leaves are ignored.
        axis_name: Inside `pmap`/`shard_map`, the mapped axis (or tuple of axes) over
            which to agree: the result is True on every device only if it is True on all.

    Returns:
        A scalar boolean array; True for a tree without floating leaves.

    Example:
        ```python
        assert not autocast.all_finite({"w": jnp.array([1.0, jnp.inf]), "step": 3})
        assert autocast.all_finite(params)
        ```
    """
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    finite = jnp.all(jnp.stack(checks)) if checks else jnp.array(True)
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """Leafwise `pred ? on_true : on_false` for two pytrees of the same structure.

    Array leaves are selected with `lax.select`, so the result is bit-identical to the
    chosen input. Non-array leaves (activation functions, Python numbers, ...) are
    taken from `on_true`.

    Args:
        pred: A scalar boolean (e.g. `state.grads_finite`).
        on_true: The pytree chosen where `pred` is True.
        on_false: A pytree with the structure of `on_true`; matching array leaves must
            have the same shape and dtype.

    Returns:
        A pytree like `on_true`.

    Raises:
        TypeError: A pair of matching array leaves differs in shape or dtype, or `pred` is
            not boolean.
        ValueError: `pred` is not a scalar.

    Example:
        ```python
        new_params = jax.tree.map(lambda p: p - 0.1, params)
        kept = autocast.select_tree(jnp.array(False), new_params, params)
        assert (kept["w1"] == params["w1"]).all()
        ```
    """
    flag = _as_flag(pred, "select_tree: `pred`")

    def leaf(a, b):
        if not (eqx.is_array(a) and eqx.is_array(b)):
            return a
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                "select_tree: matching array leaves must have the same shape and "
                f"dtype; got {a.dtype}{list(a.shape)} in `on_true` and "
                f"{b.dtype}{list(b.shape)} in `on_false`."
            )
        return jax.lax.select(flag, jnp.asarray(a), jnp.asarray(b))

    return jax.tree.map(leaf, on_true, on_false)


# ----------------------------------------------------------------------------------
# Scaler states.
# ----------------------------------------------------------------------------------


class _AbstractScalerState(eqx.Module):
    """Shared interface: `scaler`, `grads_finite`, `scale`, `unscale`, `adjust`."""

    # Names of the array leaves, used by the flax.serialization hooks.
    _leaf_fields: ClassVar[tuple[str, ...]] = ()
    # Whether `adjust(False)` lowers the scale (only then does `redo_on_nan` help).
    _can_back_off: ClassVar[bool] = False

    # Subclasses provide `scaler` (float32 scalar) and `grads_finite` (bool scalar).
    if TYPE_CHECKING:  # for the type checker only: not dataclass fields of this base

        @property
        def scaler(self) -> jax.Array: ...

    def scale(self, tree: Any) -> Any:
        """Multiply every floating leaf by the scale, in float32 (or wider).

        A float16 loss is widened first, so `loss * 2**15` cannot overflow.
        """
        return _multiply(tree, self.scaler, keep_dtype=False)

    def unscale(self, tree: Any) -> Any:
        """Multiply every floating leaf by `1 / scale` in float32 (or wider), then
        cast it back to its own dtype."""
        return _multiply(tree, 1 / self.scaler, keep_dtype=True)

    def adjust(self, grads_finite: Any) -> _AbstractScalerState:
        raise NotImplementedError

    def _with_finite(self, grads_finite: Any) -> Any:
        flag = _as_flag(grads_finite, f"{type(self).__name__}.adjust: `grads_finite`")
        return eqx.tree_at(lambda s: s.grads_finite, self, flag)


class DynamicScalerState(_AbstractScalerState):
    """State of a dynamic loss scaler (PyTorch `GradScaler` behaviour, functional).

    Args:
        patience: Grow the scale after this many consecutive finite steps (0 and 1
            both mean "on every finite step").
        adjust_factor: Growth factor, a power of two > 1.
        scaler: The current scale, a power of two in `[min_scaler, max_scaler]`.
        count: Finite steps since the last growth or backoff.
        total_resets: Number of non-finite steps seen (each one backs off).
        backoff_factor: The scale is *divided* by this on a non-finite step; a power of
            two > 1, by default `adjust_factor`.
        min_scaler: The lower bound of the scale, a power of two. The scale never
            reaches 0, so training recovers after a run of bad batches.
        max_scaler: The upper bound of the scale, a power of two (the scale never
            reaches inf).
        grads_finite: Whether the gradients returned with this state were finite.

    Raises:
        TypeError: A configuration value is not a concrete Python number, or a leaf
            value has the wrong kind (e.g. a float `count`).
        ValueError: A scale, factor or bound is not a power of two in
            `[2**-126, 2**126]`, a factor is not > 1, `min_scaler > max_scaler`,
            `scaler` lies outside them, or `count`/`total_resets` is negative.

    Configuration is static; `scaler` (float32), `count`, `total_resets` (int32) and
    `grads_finite` (bool) are array leaves. Python numbers are accepted.

    Algorithm (`adjust`), with the gradients already unscaled by the *old* scale:

    ```
    if grads_finite:
        count += 1
        if count >= patience:
            scaler = min(scaler * adjust_factor, max_scaler); count = 0
    else:
        scaler = max(scaler / backoff_factor, min_scaler); count = 0
        total_resets += 1
    ```

    Example:
        ```python
        state = autocast.DynamicScalerState(scaler=2.0**15)
        grads = jax.grad(lambda p: state.scale(loss(p)))(params)
        grads = state.unscale(grads)  # with the scale the loss was multiplied by
        state = state.adjust(autocast.all_finite(grads))  # then adjust
        ```
    """

    _leaf_fields: ClassVar[tuple[str, ...]] = (
        "scaler",
        "count",
        "total_resets",
        "grads_finite",
    )
    _can_back_off: ClassVar[bool] = True

    scaler: jax.Array
    count: jax.Array
    total_resets: jax.Array
    grads_finite: jax.Array
    patience: int = eqx.field(static=True)
    adjust_factor: float = eqx.field(static=True)
    backoff_factor: float = eqx.field(static=True)
    min_scaler: float = eqx.field(static=True)
    max_scaler: float = eqx.field(static=True)

    def __init__(
        self,
        patience: int = 2000,
        adjust_factor: float = 2.0,
        scaler: float | jax.Array = 2.0**15,
        count: int | jax.Array = 0,
        total_resets: int | jax.Array = 0,
        *,
        backoff_factor: float | None = None,
        min_scaler: float = 1.0,
        max_scaler: float = 2.0**24,
        grads_finite: bool | jax.Array = True,
    ):
        cls = type(self).__name__
        self.patience = _static_int(cls, "patience", patience)
        self.adjust_factor = _static_factor(cls, "adjust_factor", adjust_factor)
        self.backoff_factor = (
            self.adjust_factor if backoff_factor is None else _static_factor(cls, "backoff_factor", backoff_factor)
        )
        self.min_scaler = _static_float(cls, "min_scaler", min_scaler)
        self.max_scaler = _static_float(cls, "max_scaler", max_scaler)
        _check_power_of_two(cls, "min_scaler", self.min_scaler, "1.0")
        _check_power_of_two(cls, "max_scaler", self.max_scaler, "2.0**24")
        if self.min_scaler > self.max_scaler:
            raise ValueError(
                f"{cls}: `min_scaler` must be <= `max_scaler`; got "
                f"min_scaler={self.min_scaler!r}, max_scaler={self.max_scaler!r}."
            )
        self.scaler = _scalar_leaf(cls, "scaler", scaler, jnp.float32)
        _check_scale_value(cls, self.scaler, self.min_scaler, self.max_scaler)
        self.count = _scalar_leaf(cls, "count", count, jnp.int32)
        _check_nonnegative(cls, "count", self.count)
        self.total_resets = _scalar_leaf(cls, "total_resets", total_resets, jnp.int32)
        _check_nonnegative(cls, "total_resets", self.total_resets)
        self.grads_finite = _scalar_leaf(cls, "grads_finite", grads_finite, jnp.bool_)

    def adjust(self, grads_finite: Any) -> DynamicScalerState:
        """The next state after a step whose gradients were (not) finite."""
        finite = _as_flag(grads_finite, "DynamicScalerState.adjust: `grads_finite`")
        count = self.count + 1
        grow = count >= self.patience
        grown = jnp.minimum(self.scaler * self.adjust_factor, self.max_scaler)
        shrunk = jnp.maximum(self.scaler / self.backoff_factor, self.min_scaler)
        scaler = jnp.where(finite, jnp.where(grow, grown, self.scaler), shrunk)
        count = jnp.where(finite & ~grow, count, 0)
        total_resets = self.total_resets + (~finite).astype(jnp.int32)
        return eqx.tree_at(
            lambda s: (s.scaler, s.count, s.total_resets, s.grads_finite),
            self,
            (
                scaler.astype(jnp.float32),
                count.astype(jnp.int32),
                total_resets.astype(jnp.int32),
                finite,
            ),
        )


class StaticScalerState(_AbstractScalerState):
    """A fixed loss scale (jmp's `StaticLossScale`) with the dynamic interface.

    Args:
        scaler: The scale, a power of two (default `2**15`).
        grads_finite: Whether the gradients returned with this state were finite.

    `adjust(grads_finite)` only records the flag; the scale never changes.

    Example:
        ```python
        state = autocast.StaticScalerState(2.0**8)
        state, grads = autocast.dynamic_scale_grad(loss_fn)(params, batch, dynamic_scaler_state=state)
        assert float(state.scaler) == 2.0**8
        ```
    """

    _leaf_fields: ClassVar[tuple[str, ...]] = ("scaler", "grads_finite")

    scaler: jax.Array
    grads_finite: jax.Array

    def __init__(
        self,
        scaler: float | jax.Array = 2.0**15,
        *,
        grads_finite: bool | jax.Array = True,
    ):
        cls = type(self).__name__
        self.scaler = _scalar_leaf(cls, "scaler", scaler, jnp.float32)
        _check_scale_value(cls, self.scaler, 2.0**_MIN_EXPONENT, 2.0**_MAX_EXPONENT)
        self.grads_finite = _scalar_leaf(cls, "grads_finite", grads_finite, jnp.bool_)

    def adjust(self, grads_finite: Any) -> StaticScalerState:
        """The same scale, with `grads_finite` recorded."""
        return self._with_finite(grads_finite)


class NoOpScalerState(_AbstractScalerState):
    """No loss scaling (for bfloat16 or float32 training), same interface.

    `scale` and `unscale` return their input unchanged, `scaler` is 1, and
    `adjust(grads_finite)` only records the flag, so a training step written for a
    dynamic scaler also runs unchanged with this one.

    Args:
        grads_finite: Whether the gradients returned with this state were finite.

    Example:
        ```python
        bf16_loss = autocast.amp(loss_fn, compute_dtype=jnp.bfloat16)
        state = autocast.NoOpScalerState()
        state, grads = autocast.dynamic_scale_grad(bf16_loss)(params, batch, dynamic_scaler_state=state)
        ```
    """

    _leaf_fields: ClassVar[tuple[str, ...]] = ("grads_finite",)

    grads_finite: jax.Array

    def __init__(self, *, grads_finite: bool | jax.Array = True):
        self.grads_finite = _scalar_leaf(type(self).__name__, "grads_finite", grads_finite, jnp.bool_)

    @property
    def scaler(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpScalerState:
        """The same (absent) scale, with `grads_finite` recorded."""
        return self._with_finite(grads_finite)


# ----------------------------------------------------------------------------------
# flax.serialization support (optional; flax is not a dependency).
# ----------------------------------------------------------------------------------


def _to_state_dict(state: _AbstractScalerState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in state._leaf_fields}


def _from_state_dict(target: _AbstractScalerState, state: dict[str, Any]) -> Any:
    names = target._leaf_fields
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"{type(target).__name__}: the state dict lacks {missing}; got keys {sorted(state)}.")
    values = tuple(jnp.asarray(state[name], dtype=getattr(target, name).dtype) for name in names)
    return eqx.tree_at(lambda s: tuple(getattr(s, name) for name in names), target, values)


def _register_flax_serialization() -> None:
    try:
        from flax import serialization
    except ImportError:  # flax is optional
        return
    for cls in (DynamicScalerState, StaticScalerState, NoOpScalerState):
        serialization.register_serialization_state(cls, _to_state_dict, _from_state_dict, override=True)


_register_flax_serialization()
