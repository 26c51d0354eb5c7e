"""Parameters and optimizer state stored in bfloat16, updated in float32 with stochastic rounding.

Two modes per model, chosen by how the train state is built:

- **float32 master** (the default): float32 parameters and optax state, 4 + 8 bytes per
  parameter with AdamW; `amp` casts the weights to the compute dtype where they are used.
- **bfloat16 + stochastic rounding**: `to_half_params(model)` stores the parameters in
  bfloat16, `half_state(optax.adamw(...))` stores the moments in bfloat16, 2 + 4 bytes per
  parameter. Every step computes in float32 and rounds back stochastically
  (`optimizer_update(..., key=step_key)`), so updates below bfloat16's spacing are not
  lost on average.

`to_float32_params` / `to_float32_opt_state` and `to_half_params` / `to_half_opt_state`
convert a train state from one mode to the other (a float32-master checkpoint continued in
bfloat16, and back).

Sharp edges:

- Only floating leaves with at least one dimension are stored in half: scalar floats of an
  optax state (injected hyperparameters, schedules) stay float32, integer leaves (`count`)
  are never touched.
- `half_state` must be the outermost transformation (it owns the state); its updates are
  float32. Apply them with `optimizer_update(..., key=...)` for stochastic rounding of
  bfloat16 parameters.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._stochastic import _check_key, _half_dtype, stochastic_round

__all__ = [
    "HalfOptState",
    "half_state",
    "to_float32_opt_state",
    "to_float32_params",
    "to_half_opt_state",
    "to_half_params",
]

_FLOAT32 = np.dtype(jnp.float32)


def _floating_array(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _stored_in_half(x: Any) -> bool:
    """A float32 leaf with at least one dimension: what `half_state` stores in half."""
    return eqx.is_array(x) and x.dtype == _FLOAT32 and x.ndim >= 1


def _widen(tree: Any, dtype: np.dtype) -> Any:
    """Leaves of `dtype` with at least one dimension as float32 (exact)."""
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if eqx.is_array(x) and x.dtype == dtype and x.ndim >= 1 else x, tree
    )


def _upcast_half(tree: Any) -> Any:
    """float16/bfloat16 leaves as float32 (exact); everything else unchanged."""
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if _floating_array(x) and jnp.finfo(x.dtype).bits == 16 else x, tree
    )


def _narrow(tree: Any, dtype: np.dtype, key: jax.Array) -> Any:
    """float32 leaves with at least one dimension rounded stochastically to `dtype`."""
    leaves, treedef = jax.tree.flatten(tree)
    chosen = [x if _stored_in_half(x) else None for x in leaves]
    rounded = jax.tree.leaves(stochastic_round(chosen, dtype, key))
    it = iter(rounded)
    return jax.tree.unflatten(treedef, [next(it) if c is not None else x for c, x in zip(chosen, leaves)])


class HalfOptState(eqx.Module):
    """The state of `half_state`: the inner optax state with its float leaves in half, and a key.

    Attributes:
        inner: The wrapped transformation's state; its float32 leaves with at least one
            dimension (the moments) are stored in `half_state`'s `dtype`, everything else
            as the inner transformation made it.
        key: The PRNG key of the next stochastic rounding (split on every update).

    Example:
        ```python
        opt = autocast.optim.half_state(optax.adam(1e-3))
        state = opt.init(params)
        assert isinstance(state, autocast.optim.HalfOptState) and state.inner[0].mu["w1"].dtype == jnp.bfloat16
        ```
    """

    inner: Any
    key: jax.Array


def half_state(
    inner: optax.GradientTransformation, dtype: Any = jnp.bfloat16, *, key: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its state is stored in bfloat16 (or float16).

    `update` widens the stored moments to float32, runs `inner.update` on float32
    gradients and parameters, and rounds the new moments back to `dtype` stochastically
    with the key carried in the state (split on every call), so `init` and `update` stay
    pure and a run is reproducible from its state. AdamW's moments then take 4 bytes per
    parameter instead of 8; integer leaves such as `count` and scalar floats (injected
    hyperparameters) are kept as they are.

    Args:
        inner: Any `optax.GradientTransformation`, e.g. `optax.adamw(1e-3)` or a chain.
        dtype: `jnp.bfloat16` (recommended: float32's exponent range) or `jnp.float16`
            (second moments above 65504 overflow to inf).
        key: The PRNG key of the first rounding (`jax.random.key(0)` when omitted).

    Returns:
        An optax transformation whose state is a `HalfOptState`; its updates are
            float32. Put it outermost, and apply its updates with `optimizer_update(..., key=)`
            when the parameters are bfloat16 too.

    Raises:
        TypeError: `inner` is not an optax transformation, or `key` is not a PRNG key;
            from `update`: a state that is not a `HalfOptState`.
        ValueError: `dtype` is not bfloat16 or float16, or `key` is an array of keys.

    Example:
        ```python
        half_optim = autocast.optim.half_state(optax.adamw(1e-3), key=jax.random.key(1))
        state = half_optim.init(params)
        grads = jax.grad(loss)(params)
        new_params, state = autocast.optimizer_update(params, half_optim, state, grads, jnp.array(True))
        assert state.inner[0].nu["w1"].dtype == jnp.bfloat16 and state.inner[0].count.dtype == jnp.int32
        ```
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"half_state: `inner` must be an optax.GradientTransformation; got inner={inner!r}.")
    half = _half_dtype(dtype, "half_state")
    if key is not None:
        key = _check_key(key, "half_state")

    def init_fn(params: Any) -> HalfOptState:
        k = jax.random.key(0) if key is None else key
        k, sub = jax.random.split(k)
        return HalfOptState(_narrow(inner.init(_upcast_half(params)), half, sub), k)

    def update_fn(updates: Any, state: HalfOptState, params: Any = None, **extra_args: Any) -> tuple[Any, HalfOptState]:
        if not isinstance(state, HalfOptState):
            raise TypeError(
                "half_state: `state` must be the HalfOptState that this transformation's init returned; "
                f"got {type(state).__name__}."
            )
        k, sub = jax.random.split(state.key)
        new_updates, new_inner = optax.with_extra_args_support(inner).update(
            _upcast_half(updates), _widen(state.inner, half), _upcast_half(params), **extra_args
        )
        return new_updates, HalfOptState(_narrow(new_inner, half, sub), k)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def to_half_params(tree: Any, dtype: Any = jnp.bfloat16) -> Any:
    """Store the float32 leaves of a model or parameter pytree in bfloat16 (round to nearest).

    The switch to bfloat16 + stochastic rounding for one model: train the result with
    `optimizer_update(..., key=)` (and `half_state` for the optimizer). Works on Equinox
    modules (non-array leaves are kept), Flax linen params, Flax NNX state (`nnx.split`)
    and plain pytrees; integer, boolean and float64 leaves are not touched.

    Args:
        tree: The model or parameters.
        dtype: `jnp.bfloat16` (default) or `jnp.float16`.

    Returns:
        `tree` with its float32 array leaves in `dtype`.

    Raises:
        ValueError: `dtype` is not bfloat16 or float16.

    Example:
        ```python
        half_model = autocast.optim.to_half_params(model)
        assert half_model.layers[0].weight.dtype == jnp.bfloat16 and half_model.activation is model.activation
        ```
    """
    half = _half_dtype(dtype, "to_half_params")
    return jax.tree.map(lambda x: x.astype(half) if eqx.is_array(x) and x.dtype == _FLOAT32 else x, tree)


def to_float32_params(tree: Any) -> Any:
    """Widen the float16/bfloat16 leaves of a model or parameter pytree to float32 (exact).

    The way back from `to_half_params`: continue a bfloat16 + stochastic rounding run with
    float32 master weights.

    Args:
        tree: The model or parameters.

    Returns:
        `tree` with its float16/bfloat16 array leaves in float32.

    Example:
        ```python
        back = autocast.optim.to_float32_params(autocast.optim.to_half_params(params))
        assert back["w1"].dtype == jnp.float32
        ```
    """
    return _upcast_half(tree)


def to_half_opt_state(opt_state: Any, key: Any, dtype: Any = jnp.bfloat16) -> HalfOptState:
    """Convert a plain optax state (float32 master mode) into the state of `half_state(...)`.

    The float32 leaves with at least one dimension are rounded to `dtype` (to nearest);
    `key` becomes the state's rounding key.

    Args:
        opt_state: The state of an optax transformation `inner`.
        key: A PRNG key for the stochastic rounding that follows.
        dtype: `jnp.bfloat16` (default) or `jnp.float16`.

    Returns:
        A `HalfOptState` for `half_state(inner, dtype)`.

    Raises:
        TypeError: `opt_state` is already a `HalfOptState`, or `key` is not a PRNG key.
        ValueError: `dtype` is not bfloat16 or float16, or `key` is an array of keys.

    Example:
        ```python
        half = autocast.optim.to_half_opt_state(opt_state, jax.random.key(0))
        assert half.inner[0].mu["w1"].dtype == jnp.bfloat16
        ```
    """
    half = _half_dtype(dtype, "to_half_opt_state")
    key = _check_key(key, "to_half_opt_state")
    if isinstance(opt_state, HalfOptState):
        raise TypeError("to_half_opt_state: `opt_state` is already a HalfOptState.")
    inner = jax.tree.map(lambda x: x.astype(half) if _stored_in_half(x) else x, opt_state)
    return HalfOptState(inner, key)


def to_float32_opt_state(opt_state: HalfOptState) -> Any:
    """The plain optax state inside a `HalfOptState`, its half leaves widened to float32.

    Args:
        opt_state: The state of `half_state(inner, ...)`.

    Returns:
        A state for `inner` itself (the rounding key is dropped).

    Raises:
        TypeError: `opt_state` is not a `HalfOptState`.

    Example:
        ```python
        half = autocast.optim.to_half_opt_state(opt_state, jax.random.key(0))
        assert autocast.optim.to_float32_opt_state(half)[0].mu["w1"].dtype == jnp.float32
        ```
    """
    if not isinstance(opt_state, HalfOptState):
        raise TypeError(
            f"to_float32_opt_state: `opt_state` must be a HalfOptState (from half_state); got {type(opt_state).__name__}."
        )
    return _upcast_half(opt_state.inner)
