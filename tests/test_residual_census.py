"""The dtypes of what the backward pass keeps, for every real model in the test suite.

For each model of ``test_models_equinox.py`` and ``test_models_flax.py`` (same builders),
the residuals that ``jax.grad`` of the ``amp`` training loss saves are listed with
``jax.ad_checkpoint``'s saved-residual accounting. In mixed precision no float32
residual may be larger than the largest parameter: float32 activations are either
recomputed (float32 islands), or never made (matmul outputs, bias broadcasts). The
models use no ``amp_stop`` (checked), so every residual counts.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_models_equinox as eqx_models
import test_models_flax as flax_models
from helpers import walk

import autocast
from autocast import _compat

FACTORIES = eqx_models.MODELS + flax_models.MODELS


def _residuals(factory, dtype):
    case = factory()
    dynamic, static = eqx.partition(case.params, eqx.is_array)
    loss = autocast.amp(case.loss_fn, compute_dtype=dtype)

    def f(p):
        return loss(eqx.combine(p, static), case.state, case.batch)[0]

    closed = jax.make_jaxpr(f)(dynamic)
    assert not any("amp_stop" in scopes for _, scopes in walk(closed)), "the census assumes no amp_stop"
    largest = max(np.size(x) for x in jax.tree_util.tree_leaves(dynamic))
    return case.name, largest, _compat.saved_residuals(f, dynamic)


def census(factory, dtype) -> tuple[str, int, list[str]]:
    """(model name, largest parameter size, float32 residuals larger than it)."""
    name, largest, residuals = _residuals(factory, dtype)
    big = [
        f"{a.str_short()} {src}"
        for a, src in residuals
        if a.dtype == jnp.float32 and a.size > largest and "argument" not in src
    ]
    return name, largest, big


@pytest.mark.parametrize("factory", FACTORIES, ids=[f.__name__ for f in FACTORIES])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_no_float32_residual_larger_than_a_parameter(factory, dtype):
    name, largest, big = census(factory, dtype)
    assert not big, (
        f"{name} ({np.dtype(dtype).name}): float32 residuals larger than the largest parameter ({largest}):\n"
        + "\n".join(big)
    )


def test_census_sees_float32_residuals():
    """The census is not vacuous: without amp (and with ``remat_float32=False`` islands)
    float32 activations are saved, larger than any parameter."""
    case = eqx_models.eqx_vit()
    dynamic, static = eqx.partition(case.params, eqx.is_array)
    largest = max(np.size(x) for x in jax.tree_util.tree_leaves(dynamic))
    for loss in (case.loss_fn, autocast.amp(case.loss_fn, compute_dtype=jnp.bfloat16, remat_float32=False)):
        res = _compat.saved_residuals(lambda p: loss(eqx.combine(p, static), case.state, case.batch)[0], dynamic)  # noqa: B023
        assert any(a.dtype == jnp.float32 and a.size > largest and "argument" not in src for a, src in res)
