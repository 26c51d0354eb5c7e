"""Equinox and Flax (linen, NNX) models train unchanged under the float8 policy.

The models, data, optimiser and harness are those of ``test_models_equinox.py`` /
``test_models_flax.py``. Their matmuls are tiny (batch 8, width 16 to 64), below the
policy's default size threshold (16 rows, columns and contracted elements) and far below
what pays on a GPU, so the policy here is ``policies/fp8.toml`` with
``use_float8(min_dim=4, target=None)``: every weight matmul runs in float8. For each model: float8 products appear in the forward and the backward pass, the
loss decreases, gradients are finite and float32, and the step-0 gradient and the last
loss are close to float32 (looser than bfloat16: e4m3 keeps 3 significand bits, e5m2 2).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_models_equinox as eqx_models
import test_models_flax as flax_models
from helpers import compute_op_dtypes
from test_models_equinox import _array_dtypes, _run, grad_errors, measure

import autocast

POLICY = autocast.extend_policy(
    {jax.lax.dot_general_p: autocast.use_float8(min_dim=4, target=None)}, base=autocast.load_policy("fp8")
)

POLICY_ANY = autocast.extend_policy(
    {jax.lax.dot_general_p: autocast.use_float8(min_dim=4, activations=True, target=None)},
    base=autocast.load_policy("fp8"),
)

MODELS = [eqx_models.eqx_mlp, eqx_models.eqx_vit, flax_models.linen_transformer, flax_models.nnx_mlp_pytree]

# forward dot_generals of two activations: attention scores and values, 2 per block
# (eqx ViT: 2 blocks; the linen transformer: one nn.scan body)
ATTENTION_PRODUCTS = {
    eqx_models.eqx_mlp: 0,
    eqx_models.eqx_vit: 4,
    flax_models.linen_transformer: 2,
    flax_models.nnx_mlp_pytree: 0,
}

# Measured (JAX 0.12, CPU) step-0 relative L2 gradient error against float32: fp8 0.073 to
# 0.144 over these models (bfloat16 0.0045 to 0.014); last-loss error 0.0013 to 0.0072.
GRAD_TOL = 0.3
FINAL_TOL = 0.05  # relative error of the last loss, against float32


def _fp8_run(factory):
    case = factory()
    amped = autocast.amp(case.loss_fn, compute_dtype=jnp.bfloat16, amp_policy=POLICY)
    # _run(case, "float32") uses case.loss_fn as given: here the amp-transformed one
    out = _run(dataclasses.replace(case, loss_fn=amped), "float32")
    out["case"] = case
    return out


_CACHE: dict = {}


def fp8_measure(factory):
    if factory not in _CACHE:
        _CACHE[factory] = _fp8_run(factory)
    return _CACHE[factory]


@pytest.mark.parametrize("factory", MODELS, ids=lambda f: f.__name__)
def test_trains_under_fp8_policy(factory):
    m, ref, bf16 = fp8_measure(factory), measure(factory, "float32"), measure(factory, "bfloat16")
    name = m["case"].name
    fp8_ops = {dt for (prim, dt, _), n in m["census"].items() if prim == "dot_general" and dt.startswith("float8")}
    fwd = {dt: n for (prim, dt, _), n in m["census_fwd"].items() if prim == "dot_general"}
    # weight matmuls in float8; attention's products of two activations (2 per block) in bf16
    assert set(fwd) <= {"float8_e4m3fn", "bfloat16"} and fwd["float8_e4m3fn"] > 0, (name, fwd)
    assert fwd.get("bfloat16", 0) == ATTENTION_PRODUCTS[factory], (name, fwd)
    # ... which a policy with activations=True puts in float8 too
    case = m["case"]
    dynamic, static = eqx.partition(case.params, eqx.is_array)
    every = autocast.amp(case.loss_fn, compute_dtype=jnp.bfloat16, amp_policy=POLICY_ANY)
    census = compute_op_dtypes(lambda p, s, b: every(eqx.combine(p, static), s, b), dynamic, case.state, case.batch)
    assert {dt for (prim, dt, _) in census if prim == "dot_general"} == {"float8_e4m3fn"}, census
    assert fp8_ops == {"float8_e4m3fn", "float8_e5m2"}, (name, m["census"])  # forward and backward

    losses = m["losses"]
    assert np.isfinite(losses).all() and losses[-1] < 0.95 * losses[0], (name, losses)
    leaves = jax.tree_util.tree_leaves(m["grads0"])
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert _array_dtypes(m["grads0"]) == _array_dtypes(ref["grads0"])  # float32 parameters, float32 gradients

    _, err = grad_errors(m["grads0"], ref["grads0"])
    assert err < GRAD_TOL, (name, err)
    assert err > bf16["grad_err_global"], (name, err, bf16["grad_err_global"])  # float8 really ran
    final = abs(losses[-1] - ref["losses"][-1]) / abs(ref["losses"][-1])
    print(f"{name}: grad err fp8 {err:.3g} (bf16 {bf16['grad_err_global']:.3g}), last-loss err {final:.3g}")
    assert final < FINAL_TOL, (name, final, losses, ref["losses"])
    assert abs(losses[0] - bf16["losses"][0]) / abs(bf16["losses"][0]) < 0.05
