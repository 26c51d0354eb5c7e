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
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import optax

from ._loss_scale import _as_flag, select_tree

__all__ = ["optimizer_update"]


def optimizer_update(
    model: Any,
    optimizer: optax.GradientTransformation,
    opt_state: Any,
    grads: Any,
    grads_finite: Any,
) -> tuple[Any, Any]:
    """Apply one optax update if `grads_finite`, else return the inputs unchanged.

    **Arguments:**

    - `model`: a pytree of parameters or an Equinox module (non-array leaves such as
      activation functions are kept as they are).
    - `optimizer`: an `optax.GradientTransformation`, initialised with
      `optimizer.init(eqx.filter(model, eqx.is_inexact_array))`.
    - `opt_state`: its state.
    - `grads`: gradients with the structure of `eqx.filter(model,
      eqx.is_inexact_array)` (what `dynamic_scale_grad` returns with `filter=True`).
    - `grads_finite`: a scalar bool, usually `scaler_state.grads_finite`.

    **Returns:** `(model, opt_state)`, updated if `grads_finite`, otherwise the inputs
    bit for bit.

    Example:

    ```python
    state = autocast.DynamicScalerState()
    state, grads = autocast.dynamic_scale_grad(loss_fn)(params, batch, dynamic_scaler_state=state)
    params, opt_state = autocast.optimizer_update(params, optim, opt_state, grads, state.grads_finite)
    ```
    """
    finite = _as_flag(grads_finite, "optimizer_update: `grads_finite`")
    params = eqx.filter(model, eqx.is_inexact_array)
    _check_same_structure(grads, params)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_model = eqx.apply_updates(model, updates)
    return (
        select_tree(finite, new_model, model),
        select_tree(finite, new_opt_state, opt_state),
    )


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
