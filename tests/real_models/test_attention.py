"""Attention layers with padding masks, as Equinox and Flax ship them, under ``amp``.

- ``eqx.nn.MultiheadAttention`` (Equinox), per example under ``jax.vmap``, with a
  ``(query, key)`` boolean mask;
- ``flax.linen.MultiHeadDotProductAttention`` with ``nn.make_attention_mask``;
- ``flax.nnx.MultiHeadAttention`` with the same mask, through ``nnx.split``/``nnx.merge``.

The padded batch has sequence lengths 16, 11, 5 and 1 and masks both queries and keys,
so the padded query rows are fully masked (every score is the mask's fill value): float32
gives those rows a uniform softmax and finite gradients, and so must ``amp``. The loss is a
masked mean squared error against random targets.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

B, L, D, HEADS = 4, 16, 32, 4
LENGTHS = (16, 11, 5, 1)


def _batch(padded: bool):
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (B, L, D))
    y = jax.random.normal(ky, (B, L, D))
    lengths = jnp.array(LENGTHS if padded else (L,) * B)
    valid = jnp.arange(L)[None, :] < lengths[:, None]  # (B, L)
    return dict(x=x, y=y, valid=valid)


BATCHES = {"padded": _batch(True), "unpadded": _batch(False)}
# From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
TOL = {"float16": Tol(loss=5e-4, grad=5e-3), "bfloat16": Tol(loss=2e-3, grad=3e-2)}


def _masked_mse(out, batch):
    w = batch["valid"][..., None].astype(out.dtype)
    return jnp.sum(w * (out - batch["y"]) ** 2) / (jnp.sum(w) * D)


def equinox_mha() -> Model:
    mha = eqx.nn.MultiheadAttention(HEADS, D, key=jax.random.key(0))
    params, static = eqx.partition(mha, eqx.is_array)

    def loss(params, batch):
        m = eqx.combine(params, static)
        mask = batch["valid"][:, :, None] & batch["valid"][:, None, :]  # (B, Lq, Lk)
        out = jax.vmap(lambda x, mk: m(x, x, x, mask=mk))(batch["x"], mask)
        return _masked_mse(out, batch)

    return Model("eqx.nn.MultiheadAttention", "equinox", params, BATCHES, loss, TOL)


def linen_mha() -> Model:
    mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)
    batch = BATCHES["padded"]
    mask = nn.make_attention_mask(batch["valid"], batch["valid"])
    params = mha.init(jax.random.key(0), batch["x"], mask=mask)

    def loss(params, batch):
        mask = nn.make_attention_mask(batch["valid"], batch["valid"])  # (B, 1, Lq, Lk)
        out = mha.apply(params, batch["x"], mask=mask)
        return _masked_mse(out, batch)

    return Model("linen.MultiHeadDotProductAttention", "flax", params, BATCHES, loss, TOL)


def nnx_mha() -> Model:
    mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D, decode=False, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mha)

    def loss(params, batch):
        m = nnx.merge(graphdef, params)
        mask = nn.make_attention_mask(batch["valid"], batch["valid"])
        out = m(batch["x"], mask=mask)
        return _masked_mse(out, batch)

    return Model("nnx.MultiHeadAttention", "flax", params, BATCHES, loss, TOL)


MODELS = {"equinox": equinox_mha, "linen": linen_mha, "nnx": nnx_mha}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_attention(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
