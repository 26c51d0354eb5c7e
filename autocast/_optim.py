"""Optimizer steps that are skipped, bit for bit, when the gradients are not finite.

Recipes (each one is exercised in `tests/test_optim.py`):

- **Skip a step.** `model, opt_state = optimizer_update(model, optim, opt_state,
  grads, state.grads_finite)`. On a non-finite step both are returned unchanged
  (bit-identical), so the optimizer's step count and moments do not move.
- **Gradient clipping** goes inside the optimizer, e.g.
  `optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))`: the gradients
  returned by `dynamic_scale_(value_and_)grad` are already unscaled, so the clip
  threshold means the same as without loss scaling.
- **`optax.apply_if_finite`** may wrap the optimizer as a second guard for code paths
  that call `optim.update` directly. Behind `optimizer_update` it never sees a
  non-finite step, so its counter never reaches `max_consecutive_errors`, after which
  it would otherwise apply the NaN update (optax 0.2.8 does, on a run of bad batches
  such as a dynamic scale backing off from a high initial value).
- **Gradient accumulation** with `optax.MultiSteps(optim, every_k_schedule=k)`:
  each micro-batch's gradients are unscaled with their own scale before being
  accumulated, so the scale may change between micro-batches. A non-finite
  micro-batch is dropped entirely (the accumulator and its step counter are left
  unchanged), so the effective batch still averages k finite micro-batches.
  `should_skip_update_fn=optax.skip_not_finite` has the same effect on its own.
- **bfloat16 parameters** (`to_half_params`): pass `key=` (a fresh key every step). The
  update is computed in float32 and rounded back stochastically, leaf by leaf with
  independent random bits, so updates below bfloat16's spacing are not lost on average.
  Without a key the sum is rounded to nearest (what `optax.apply_updates` does).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._loss_scale import _as_flag, select_tree
from ._stochastic import _check_key, _round_leaves

__all__ = ["optimizer_update"]


def optimizer_update(
    model: Any,
    optimizer: optax.GradientTransformation,
    opt_state: Any,
    grads: Any,
    grads_finite: Any,
    *,
    key: Any = None,
) -> tuple[Any, Any]:
    """Apply one optax update if `grads_finite`, else return the inputs unchanged.

    Args:
        model: A pytree of parameters or an Equinox module (non-array leaves such as
            activation functions are kept as they are).
        optimizer: An `optax.GradientTransformation`, initialised with
            `optimizer.init(eqx.filter(model, eqx.is_inexact_array))`.
        opt_state: Its state.
        grads: Gradients with the structure of `eqx.filter(model,
            eqx.is_inexact_array)` (what `dynamic_scale_grad` returns with `filter=True`).
        grads_finite: A scalar bool, usually `scaler_state.grads_finite`.
        key: A PRNG key, a fresh one every step (e.g. `jax.random.fold_in(key, step)`),
            for parameters stored in bfloat16/float16 (`to_half_params`): the optimizer then
            sees float32 parameters and gradients, and the new parameters are rounded back to
            their dtype stochastically (as `stochastic_round` does).
            float32 leaves are updated exactly as without a key. Without a key, each
            parameter is `(param + update)` cast to the parameter's dtype, as in
            `optax.apply_updates`: half parameters are rounded to nearest, which loses
            updates below half their spacing.

    Returns:
        `(model, opt_state)`, updated if `grads_finite`, otherwise the inputs
            bit for bit.

    Raises:
        ValueError: `grads` does not have the structure of the model's inexact arrays,
            `grads_finite` is not a scalar, or `key` is an array of several keys.
        TypeError: `grads_finite` is not boolean, or `key` is not a PRNG key.

    Example:
        ```python
        state = autocast.DynamicScalerState()
        state, grads = autocast.dynamic_scale_grad(loss_fn)(params, batch, dynamic_scaler_state=state)
        new_params, new_opt_state = autocast.optimizer_update(params, optim, opt_state, grads, state.grads_finite)

        # bfloat16 parameters stay bfloat16 (float32 updates are rounded to nearest)
        half = autocast.optim.to_half_params(params)
        half, _ = autocast.optimizer_update(half, optim, opt_state, grads, state.grads_finite)
        assert half["w1"].dtype == jnp.bfloat16
        ```
    """
    finite = _as_flag(grads_finite, "optimizer_update: `grads_finite`")
    params = eqx.filter(model, eqx.is_inexact_array)
    _check_same_structure(grads, params)
    if key is None:
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_model = eqx.combine(_apply_updates(params, updates), model)
    else:
        key = _check_key(key, "optimizer_update")
        new_model, new_opt_state = _rounded_update(model, params, optimizer, opt_state, grads, key)
    return (
        select_tree(finite, new_model, model),
        select_tree(finite, new_opt_state, opt_state),
    )


def _apply_updates(params: Any, updates: Any) -> Any:
    """`param + update` in each parameter's own dtype (as `optax.apply_updates`; Equinox's
    `apply_updates` would promote a bfloat16 parameter with a float32 update to float32)."""

    def leaf(u: Any, p: Any) -> Any:
        return p if u is None else jnp.asarray(p + u).astype(p.dtype)

    return jax.tree.map(leaf, updates, params, is_leaf=lambda x: x is None)


def _is_half(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 16


def _rounded_update(model: Any, params: Any, optimizer: Any, opt_state: Any, grads: Any, key: jax.Array) -> Any:
    """The update in float32, half parameters rounded back stochastically (one seed per leaf)."""
    wide = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32) if _is_half(x) else x, tree)
    updates, new_opt_state = optimizer.update(wide(grads), opt_state, wide(params))
    leaves, treedef = jax.tree.flatten(params)
    new = list(leaves)
    half = []
    flat_updates = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]  # (missing from jax's stubs)
    for i, (p, u) in enumerate(zip(leaves, flat_updates)):
        if u is None:
            continue
        if _is_half(p):
            half.append(i)
            new[i] = p.astype(jnp.float32) + u.astype(jnp.float32)
        else:  # as optax.apply_updates
            new[i] = jnp.asarray(p + u).astype(p.dtype)
    rounded = _round_leaves([new[i] for i in half], [leaves[i].dtype for i in half], key)
    for i, r in zip(half, rounded):
        new[i] = r
    return eqx.combine(jax.tree.unflatten(treedef, new), model), new_opt_state


def _check_same_structure(grads: Any, params: Any) -> None:
    """A clear error for gradients whose pytree structure is not the model's (a raw pytree
    error from inside optax otherwise)."""
    got: Any = jax.tree.structure(grads)
    want: Any = jax.tree.structure(params)
    if got == want:
        return
    paths = lambda tree: {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}  # noqa: E731
    g, p = paths(grads), paths(params)
    diff = []
    if p - g:
        diff.append(f"missing from `grads`: {', '.join(sorted(p - g)[:8])}")
    if g - p:
        diff.append(f"not in the model: {', '.join(sorted(g - p)[:8])}")
    detail = f" ({'; '.join(diff)})" if diff else ""
    raise ValueError(
        "optimizer_update: `grads` must have the structure of the model's inexact arrays "
        f"(`eqx.filter(model, eqx.is_inexact_array)`, what `dynamic_scale_grad(..., filter=True)` returns){detail}.\n"
        f"  grads: {_short(got)}\n  model: {_short(want)}"
    )


def _short(treedef: Any, limit: int = 400) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[: limit - 3] + "..."
