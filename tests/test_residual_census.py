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


def _geglu(params, x):
    """Gemma's gated MLP: one matmul to both halves, `gelu(gate) * up` on slices of it."""
    w_gate_up, w_down = params
    h = jnp.einsum("btd,cdh->btch", x, w_gate_up)
    return jnp.sum(jnp.einsum("bth,hd->btd", jax.nn.gelu(h[..., 0, :]) * h[..., 1, :], w_down) ** 2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_gated_mlp_keeps_its_halves_in_half_precision(dtype):
    """Slices that only a float32 island reads join the island: the checkpoint keeps the
    matmul's half-precision result, not float32 copies of the gate and the up projection
    (corpus Gemma 3: 22 % more residual bytes before). Values and gradients as unfused."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((4, 16, 64)), jnp.float32)
    params = (
        jnp.asarray(r.standard_normal((2, 64, 128)) * 0.1, jnp.float32),
        jnp.asarray(r.standard_normal((128, 64)) * 0.1, jnp.float32),
    )
    loss = autocast.amp(_geglu, compute_dtype=dtype)
    residuals = _compat.saved_residuals(lambda p: loss(p, x), params)
    activations = [(a.dtype, a.shape) for a, src in residuals if "argument" not in src]
    assert (np.dtype(dtype), (4, 16, 2, 128)) in activations, activations
    assert not [d for d, s in activations if d == jnp.float32 and np.prod(s) >= 4 * 16 * 128], activations
    ref_loss, ref_grads = jax.value_and_grad(_geglu)(params, x)
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params, x)
    assert abs(float(got_loss) - float(ref_loss)) < 3e-2 * abs(float(ref_loss))
    for g, ref in zip(got_grads, ref_grads):
        assert g.dtype == jnp.float32
        assert float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref)) < 3e-2
