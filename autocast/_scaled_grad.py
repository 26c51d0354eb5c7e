"""Loss-scaled `grad` / `value_and_grad` that thread a scaler state through a step.

`dynamic_scale_value_and_grad(fun)(*args, dynamic_scaler_state=state)`:

1. calls `fun`, checks that the loss is a scalar floating-point array, and multiplies
   it by `state.scaler` in float32 (a float16 loss times 2**15 does not overflow);
2. differentiates the scaled loss (`filter=True`: like `equinox.filter_grad`, only
   floating array leaves; `filter=False`: like `jax.grad` with `argnums`);
3. unscales the gradients with the *same* scale, in each parameter's dtype;
4. checks the gradients (not aux) for inf/NaN, agreeing across `axis_name` if given;
5. with `redo_on_nan=k`, backs off and recomputes up to k times inside the step;
6. returns `state.adjust(grads_finite)` with the unscaled value and gradients. The
   returned state's `grads_finite` says whether the gradients may be applied.

Sharp edges:

- Gradients are *not* reduced across devices: under `pmap`/`shard_map` `axis_name`
  only makes the finite flag (hence the new scale) agree. Average the gradients
  yourself (`jax.lax.pmean(grads, axis_name)`).
- `redo_on_nan` recomputes the whole forward and backward pass in a
  `lax.while_loop`; it only applies to a `DynamicScalerState` (a static or no-op
  scale would not change between attempts).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._loss_scale import _AbstractScalerState, all_finite

__all__ = ["dynamic_scale_grad", "dynamic_scale_value_and_grad"]

_MISSING = object()


def _check_options(name: str, has_aux: Any, redo_on_nan: Any, filter: Any, argnums: Any) -> None:
    if not isinstance(has_aux, bool):
        raise TypeError(f"{name}: `has_aux` must be a bool; got has_aux={has_aux!r}.")
    if not isinstance(filter, bool):
        raise TypeError(f"{name}: `filter` must be a bool; got filter={filter!r}.")
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, int):
        raise TypeError(
            f"{name}: `redo_on_nan` must be a non-negative int (the maximum number of "
            f"recomputations); got redo_on_nan={redo_on_nan!r}."
        )
    if redo_on_nan < 0:
        raise ValueError(f"{name}: `redo_on_nan` must be >= 0; got redo_on_nan={redo_on_nan}.")
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if (
        not nums
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums)
        or len(set(nums)) != len(nums)
    ):
        raise ValueError(
            f"{name}: `argnums` must be a non-negative int or a non-empty tuple of "
            f"distinct non-negative ints; got argnums={argnums!r}."
        )


def _check_state(name: str, state: Any, args: Sequence[Any]) -> _AbstractScalerState:
    if state is _MISSING:
        hint = ""
        if any(isinstance(a, _AbstractScalerState) for a in args):
            hint = " It was passed positionally; pass it by keyword instead."
        raise TypeError(
            f"{name}: missing the keyword argument `dynamic_scaler_state`; call "
            f"g(*args, dynamic_scaler_state=state) with a DynamicScalerState, "
            f"StaticScalerState or NoOpScalerState.{hint}"
        )
    if not isinstance(state, _AbstractScalerState):
        raise TypeError(
            f"{name}: `dynamic_scaler_state` must be a DynamicScalerState, "
            f"StaticScalerState or NoOpScalerState; got {type(state).__name__}."
        )
    return state


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    if eqx.is_array(x):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def _check_loss(name: str, out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"{name}: with has_aux=True, `fun` must return a pair (loss, aux); got {_describe(out)}.")
        loss, aux = out
    else:
        loss, aux = out, None
    if not (eqx.is_array(loss) or isinstance(loss, (int, float, complex))):
        raise TypeError(
            f"{name}: `fun` must return a scalar floating-point loss"
            f"{' as the first element of its (loss, aux) pair' if has_aux else ''}; "
            f"got {_describe(loss)}"
            f"{' (did you mean has_aux=True?)' if isinstance(loss, (tuple, list)) else ''}."
        )
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"{name}: the loss returned by `fun` must be a scalar floating-point array "
            f"(float16, bfloat16, float32 or float64); got shape {loss.shape} and "
            f"dtype {loss.dtype}."
        )
    return loss, aux


def _value_and_grads(
    name: str,
    fun: Callable,
    state: _AbstractScalerState,
    args: tuple,
    kwargs: dict,
    *,
    has_aux: bool,
    filter: bool,
    argnums: int | tuple[int, ...],
) -> tuple[jax.Array, Any, Any]:
    """One attempt: (unscaled value, aux, grads unscaled with `state`'s scale)."""

    def scaled(*args_):
        loss, aux = _check_loss(name, fun(*args_, **kwargs), has_aux)
        return state.scale(loss), (loss, aux)

    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if max(nums) >= len(args):
        raise ValueError(
            f"{name}: argnums={argnums!r} refers to positional argument {max(nums)}, "
            f"but only {len(args)} positional argument(s) were given."
        )
    if filter:
        parts = [eqx.partition(args[i], eqx.is_inexact_array) for i in nums]

        def on_diff(diff):
            args_ = list(args)
            for i, d, (_, static) in zip(nums, diff, parts):
                args_[i] = eqx.combine(d, static)
            return scaled(*args_)

        diff = tuple(d for d, _ in parts)
        (_, (loss, aux)), grads = jax.value_and_grad(on_diff, has_aux=True)(diff)
        if not isinstance(argnums, tuple):
            grads = grads[0]
    else:
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)(*args)
    return loss, aux, state.unscale(grads)


def retry_while_non_finite(
    attempt: Callable[[_AbstractScalerState], tuple[Any, jax.Array]],
    state: _AbstractScalerState,
    redo_on_nan: int,
) -> tuple[_AbstractScalerState, Any, jax.Array]:
    """Run `attempt(state) -> (results, finite)`; while not finite, back the scale off
    and run it again, at most `redo_on_nan` times (in a `lax.while_loop`).

    Returns:
        `(state used by the last attempt, its results, its finite flag)`.
    """
    results, finite = attempt(state)
    if not (redo_on_nan and state._can_back_off):
        return state, results, finite
    # The first attempt stays outside the loop so the carry has exactly the types
    # (including varying-manual-axes types under shard_map) of a real attempt.
    dynamic, static = eqx.partition(results, eqx.is_array)

    def cond(carry):
        i, _, finite, _ = carry
        return jnp.logical_not(finite) & (i < redo_on_nan)

    def body(carry):
        i, state, _, _ = carry
        state = state.adjust(False)
        results, finite = attempt(state)
        return i + 1, state, finite, eqx.filter(results, eqx.is_array)

    carry = (jnp.zeros((), jnp.int32), state, finite, dynamic)
    _, state, finite, dynamic = jax.lax.while_loop(cond, body, carry)
    return state, eqx.combine(dynamic, static), finite


def _scaled_value_and_grad(
    name: str,
    fun: Callable,
    state: _AbstractScalerState,
    args: tuple,
    kwargs: dict,
    *,
    has_aux: bool,
    redo_on_nan: int,
    filter: bool,
    argnums: int | tuple[int, ...],
    axis_name: Hashable | None,
) -> tuple[_AbstractScalerState, jax.Array, Any, Any]:
    attempt = functools.partial(
        _value_and_grads,
        name,
        fun,
        args=args,
        kwargs=kwargs,
        has_aux=has_aux,
        filter=filter,
        argnums=argnums,
    )

    # The finite check covers the gradients only: a NaN in aux is not a reason to
    # back off (jaxamp's scaler halves on it).
    def checked(state):
        out = attempt(state)
        return out, all_finite(out[2], axis_name=axis_name)

    state, (loss, aux, grads), finite = retry_while_non_finite(checked, state, redo_on_nan)
    return state.adjust(finite), loss, aux, grads


def _make(
    name: str,
    fun: Callable,
    *,
    has_aux: bool,
    redo_on_nan: int,
    filter: bool,
    argnums: int | tuple[int, ...],
    axis_name: Hashable | None,
    with_value: bool,
) -> Callable:
    if not callable(fun):
        raise TypeError(f"{name}: `fun` must be callable; got {type(fun).__name__}.")
    _check_options(name, has_aux, redo_on_nan, filter, argnums)

    @functools.wraps(fun)
    def wrapper(*args, dynamic_scaler_state=_MISSING, **kwargs):
        state = _check_state(name, dynamic_scaler_state, args)
        new_state, loss, aux, grads = _scaled_value_and_grad(
            name,
            fun,
            state,
            args,
            kwargs,
            has_aux=has_aux,
            redo_on_nan=redo_on_nan,
            filter=filter,
            argnums=argnums,
            axis_name=axis_name,
        )
        if with_value:
            return new_state, (((loss, aux) if has_aux else loss), grads)
        return new_state, ((grads, aux) if has_aux else grads)

    _add_state_to_signature(wrapper, fun)
    return wrapper


def _add_state_to_signature(wrapper: Callable, fun: Callable) -> None:
    """Advertise the `dynamic_scaler_state` keyword, so that tools which bind
    arguments to the signature (e.g. `equinox.filter_jit`) accept it."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):  # builtins without a signature
        signature = None
    if signature is None or "dynamic_scaler_state" in signature.parameters:
        del wrapper.__wrapped__  # type: ignore[attr-defined]  # fall back to (*args, dynamic_scaler_state, **kwargs)
        return
    params = list(signature.parameters.values())
    state = inspect.Parameter("dynamic_scaler_state", inspect.Parameter.KEYWORD_ONLY)
    at = len(params)
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    params.insert(at, state)
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=inspect.Signature.empty
    )


def dynamic_scale_value_and_grad(
    fun: Callable | None = None,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: int | tuple[int, ...] = 0,
    axis_name: Hashable | None = None,
) -> Callable:
    """Loss-scaled `value_and_grad` that also updates a scaler state.

    Args:
        fun: The loss function, returning a scalar floating-point loss (or
            `(loss, aux)` with `has_aux=True`). Can be omitted to use as a decorator with
            arguments: `@dynamic_scale_value_and_grad(has_aux=True)`.
        has_aux: As in `jax.value_and_grad`. NaNs in aux do not count as a failure.
        redo_on_nan: On non-finite gradients, back off and recompute at most this many
            times inside the step (`lax.while_loop`; dynamic scaler only).
        filter: If True, differentiate like `equinox.filter_value_and_grad` (every
            floating array leaf of the differentiated arguments; other leaves get `None`);
            if False, like `jax.value_and_grad`.
        argnums: Which positional argument(s) to differentiate.
        axis_name: Under `pmap`/`shard_map`, the mapped axis over which all devices
            agree on the finite flag and hence on the new scale.

    Returns:
        A function `g(*args, dynamic_scaler_state=state, **kwargs)` returning
            `(new_state, (value, grads))`, or `(new_state, ((value, aux), grads))` with
            `has_aux`. `value` is exactly what `fun` returned (not scaled); `grads` are
            unscaled with the scale the loss was multiplied by and have the parameters'
            dtypes; `new_state.grads_finite` says whether they are finite. (Without
            `fun`: a decorator taking it.)

    Raises:
        TypeError: `fun` is not callable, `has_aux` or `filter` is not a bool,
            `redo_on_nan` is not an int; when `g` is called: `dynamic_scaler_state` is
            missing or not a scaler state, or `fun` does not return a scalar
            floating-point loss (or a `(loss, aux)` pair with `has_aux`).
        ValueError: `redo_on_nan` is negative, or `argnums` is not a non-negative int or
            a non-empty tuple of distinct ones (or names an argument `g` was not given).

    Example:
        ```python
        def loss_and_metrics(params, batch):
            loss = loss_fn(params, batch)
            return loss, {"loss": loss}

        grad_fn = autocast.dynamic_scale_value_and_grad(autocast.amp(loss_and_metrics), has_aux=True)
        state = autocast.DynamicScalerState()
        state, ((loss, metrics), grads) = grad_fn(params, batch, dynamic_scaler_state=state)
        params, opt_state = autocast.optimizer_update(params, optim, opt_state, grads, state.grads_finite)
        ```
    """
    if fun is None:
        return functools.partial(
            dynamic_scale_value_and_grad,
            has_aux=has_aux,
            redo_on_nan=redo_on_nan,
            filter=filter,
            argnums=argnums,
            axis_name=axis_name,
        )
    return _make(
        "dynamic_scale_value_and_grad",
        fun,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        argnums=argnums,
        axis_name=axis_name,
        with_value=True,
    )


def dynamic_scale_grad(
    fun: Callable | None = None,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: int | tuple[int, ...] = 0,
    axis_name: Hashable | None = None,
) -> Callable:
    """Loss-scaled `grad` that also updates a scaler state.

    Takes the arguments of `dynamic_scale_value_and_grad`, and raises the same errors.

    Args:
        fun: The loss function, returning a scalar floating-point loss (or
            `(loss, aux)` with `has_aux=True`); omit it to use as a decorator with
            arguments.
        has_aux: As in `jax.grad`. NaNs in aux do not count as a failure.
        redo_on_nan: On non-finite gradients, back off and recompute at most this many
            times inside the step (dynamic scaler only).
        filter: If True, differentiate like `equinox.filter_grad`; if False, like
            `jax.grad`.
        argnums: Which positional argument(s) to differentiate.
        axis_name: Under `pmap`/`shard_map`, the mapped axis over which all devices
            agree on the finite flag and hence on the new scale.

    Returns:
        A function `g(*args, dynamic_scaler_state=state, **kwargs)` returning
            `(new_state, grads)`, or `(new_state, (grads, aux))` with `has_aux`.

    Example:
        ```python
        state = autocast.DynamicScalerState()
        state, grads = autocast.dynamic_scale_grad(autocast.amp(loss_fn))(params, batch, dynamic_scaler_state=state)
        ```
    """
    if fun is None:
        return functools.partial(
            dynamic_scale_grad,
            has_aux=has_aux,
            redo_on_nan=redo_on_nan,
            filter=filter,
            argnums=argnums,
            axis_name=axis_name,
        )
    return _make(
        "dynamic_scale_grad",
        fun,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        argnums=argnums,
        axis_name=axis_name,
        with_value=False,
    )
