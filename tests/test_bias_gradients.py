"""Bias gradients accumulate in float32.

A float32 bias added to half-precision activations is broadcast over the batch; JAX's
transpose of that broadcast (explicit ``broadcast_in_dim`` or the implicit size-1
broadcasting of ``add``) is the ``reduce_sum`` that forms the bias gradient, a sum of
thousands of terms. ``amp`` broadcasts such operands in float32 before narrowing them, so
the sum runs in float32 (fused with the convert: no float32 activation-sized buffer).

Each case compares the bias gradient of ``jax.grad(amp(loss, bfloat16))`` with the float32
gradient of the same loss, at a batch where a half-precision sum is visibly wrong
(cotangents of one sign: a softplus loss).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import walk

import autocast

BF16 = jnp.bfloat16
TOL = 1e-2


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _head(h, w2):
    """Another matmul after the biased layer, then a loss whose cotangents share a sign."""
    return jnp.mean(jax.nn.softplus(h.reshape(h.shape[0], -1) @ w2))


def _keys(n):
    return jax.random.split(jax.random.key(0), n)


def case_jnp():
    k = _keys(4)
    p = {
        "w": jax.random.normal(k[0], (64, 64)) / 8,
        "b": jax.random.normal(k[1], (64,)),
        "w2": jax.random.normal(k[2], (64, 8)) / 8,
    }
    x = jax.random.normal(k[3], (8192, 64))

    def loss(p, x):
        return _head(x @ p["w"] + p["b"], p["w2"])

    return loss, p, x, lambda g: g["b"]


def case_jnp_explicit_broadcast():
    loss0, p, x, bias = case_jnp()

    def loss(p, x):
        return _head(x @ p["w"] + jnp.broadcast_to(p["b"], (x.shape[0], 64)), p["w2"])

    return loss, p, x, bias


def case_eqx_linear():
    k = _keys(3)
    lin = eqx.nn.Linear(64, 64, key=k[0])
    w2 = jax.random.normal(k[1], (64, 8)) / 8
    x = jax.random.normal(k[2], (8192, 64))

    def loss(lin, x):
        return _head(jax.vmap(lin)(x), w2)

    return loss, lin, x, lambda g: g.bias


def case_eqx_conv():
    k = _keys(3)
    conv = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k[0])
    w2 = jax.random.normal(k[1], (16 * 16 * 16, 4)) / 64
    x = jax.random.normal(k[2], (32, 8, 16, 16))

    def loss(conv, x):
        return _head(jax.vmap(conv)(x), w2)

    return loss, conv, x, lambda g: g.bias


def _flax(module, x_shape, feat):
    k = _keys(3)
    x = jax.random.normal(k[0], x_shape)
    params = module.init(k[1], x)
    w2 = jax.random.normal(k[2], (feat, 4)) / np.sqrt(feat)

    def loss(params, x):
        return _head(module.apply(params, x), w2)

    return loss, params, x, lambda g: g["params"]["bias"]


def case_flax_dense():
    return _flax(nn.Dense(64), (8192, 64), 64)


def case_flax_conv():
    return _flax(nn.Conv(16, (3, 3)), (32, 16, 16, 8), 16 * 16 * 16)


def case_flax_dense_general():
    return _flax(nn.DenseGeneral((4, 16), axis=-1), (8192, 64), 64)


CASES = {
    "jnp": case_jnp,
    "jnp broadcast_to": case_jnp_explicit_broadcast,
    "eqx Linear": case_eqx_linear,
    "eqx Conv2d": case_eqx_conv,
    "flax Dense": case_flax_dense,
    "flax Conv": case_flax_conv,
    "flax DenseGeneral": case_flax_dense_general,
}


def _grads(case):
    loss, params, x, bias = case()
    g32 = jax.jit(jax.grad(loss))(params, x)
    amp_grad = jax.grad(autocast.amp(loss, compute_dtype=BF16))
    g16 = jax.jit(amp_grad)(params, x)
    return bias(g16), bias(g32), jax.make_jaxpr(amp_grad)(params, x)


@pytest.mark.parametrize("name", list(CASES))
def test_bias_gradient_matches_float32(name):
    got, want, grad_jaxpr = _grads(CASES[name])
    assert got.dtype == want.dtype == jnp.float32
    err = _rel(got, want)
    assert err <= TOL, f"{name}: bias gradient relative error {err:.2e} in bfloat16 (float32 reference), want <= {TOL}"
    half_sums = [
        str(e)
        for e, _ in walk(grad_jaxpr)
        if e.primitive.name == "reduce_sum" and e.invars[0].aval.dtype != jnp.float32
    ]
    assert not half_sums, f"{name}: the backward pass sums in half precision: {half_sums}"


def test_scale_operand_is_recomputed_not_saved():
    """``x16 * scale32`` (a learned per-channel scale): the scale's gradient sums in float32
    and the broadcast scale is not kept as an activation-sized residual."""
    k = _keys(3)
    p = {"w": jax.random.normal(k[0], (64, 64)) / 8, "s": 1 + jax.random.normal(k[1], (64,)) / 4}
    x = jax.random.normal(k[2], (8192, 64))

    def loss(p, x):
        return jnp.mean(jnp.square((x @ p["w"]) * p["s"] + 1.0))

    g32 = jax.grad(loss)(p, x)
    amp_loss = autocast.amp(loss, compute_dtype=BF16)
    g16 = jax.jit(jax.grad(amp_loss))(p, x)
    assert _rel(g16["s"], g32["s"]) <= TOL
    big = [a.str_short() for a, _ in autocast._compat.saved_residuals(amp_loss, p, x) if a.size >= 8192 * 64]
    # x (for d/dw), the matmul result (for d/ds) and the product (the square's recomputed
    # island): all bfloat16; not the broadcast scale
    assert len(big) <= 3 and all(s.startswith("bfloat16") for s in big), big
