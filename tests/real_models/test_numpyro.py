"""NumPyro under ``amp``: a Bayesian neural network's ELBO, as NumPyro's SVI computes it.

The model (``numpyro.sample`` statements, a Student-t likelihood under a data ``plate``) and
its ``AutoNormal`` guide are NumPyro's; the loss is ``Trace_ELBO(num_particles=2).loss`` with
the guide's parameters from ``SVI.init`` (unconstrained locations and softplus scales), the
PRNG key part of the batch. The padded batch pads the data with zero rows that the
likelihood leaves out with ``numpyro.handlers.mask``, as a fixed-shape data pipeline does.
What it exercises: reparameterised sampling in the guide, ``lgamma``/``log1p``/``xlogy``
log densities, KL terms by Monte Carlo, constraint transforms (softplus, exp) and the
``mask`` handler's ``where``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks
from numpyro import infer
from numpyro.infer import autoguide

N, D, H = 64, 8, 16


def _bnn(x, y, valid):
    w1 = numpyro.sample("w1", dist.Normal(0, 1).expand([D, H]).to_event(2))
    w2 = numpyro.sample("w2", dist.Normal(0, 1).expand([H]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    mean = jnp.tanh(x @ w1) @ w2
    with numpyro.plate("data", x.shape[0]), numpyro.handlers.mask(mask=valid):
        numpyro.sample("obs", dist.StudentT(4.0, mean, sigma), obs=y)


def bnn() -> Model:
    x = jax.random.normal(jax.random.key(1), (N, D))
    y = x @ jnp.linspace(-1.0, 1.0, D) + 0.1 * jax.random.normal(jax.random.key(2), (N,))
    valid = jnp.arange(N) < 40
    guide = autoguide.AutoNormal(_bnn)
    svi = infer.SVI(_bnn, guide, optax.adam(1e-2), infer.Trace_ELBO())
    params = svi.get_params(svi.init(jax.random.key(0), x, y, jnp.ones(N, bool)))
    key = jax.random.key(3)
    batches = {
        "padded": dict(x=jnp.where(valid[:, None], x, 0.0), y=jnp.where(valid, y, 0.0), valid=valid, key=key),
        "unpadded": dict(x=x, y=y, valid=jnp.ones(N, bool), key=key),
    }

    def loss(params, batch):
        elbo = infer.Trace_ELBO(num_particles=2)
        return elbo.loss(batch["key"], params, _bnn, guide, batch["x"], batch["y"], batch["valid"])

    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=1.5e-5, grad=2e-4), "bfloat16": Tol(loss=1e-4, grad=1.5e-3)}
    return Model("Bayesian MLP, SVI ELBO (AutoNormal)", "numpyro", params, batches, loss, tol)


MODELS = {"bnn": bnn}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_numpyro(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
