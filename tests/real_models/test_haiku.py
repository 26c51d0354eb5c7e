"""Haiku (DeepMind's ``dm-haiku``) models under ``amp``: the models jmp was written for.

Haiku models are functions under ``hk.transform``/``hk.transform_with_state``; ``amp`` wraps
the loss built on the transformed ``apply``, and ``init`` makes the float32 parameters.

- ``hk.nets.ResNet18`` (BatchNorm in training mode, its state threaded through
  ``transform_with_state``) on 32x32 random images, softmax cross-entropy. An image
  model has no padding: the padded and unpadded batches are the same.
- A pre-LayerNorm transformer encoder built from Haiku's own ``hk.MultiHeadAttention``,
  ``hk.LayerNorm``, ``hk.Linear`` and ``hk.Embed``, as Haiku's transformer example does,
  with a padding mask on queries and keys: the padded rows are fully masked (Haiku fills
  masked scores with -1e30).
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

B = 4


def resnet18() -> Model:
    def forward(x, is_training):
        return hk.nets.ResNet18(num_classes=10)(x, is_training=is_training)

    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.key(1), (B, 32, 32, 3))
    y = jax.random.randint(jax.random.key(2), (B,), 0, 10)
    params, state = net.init(jax.random.key(0), x, is_training=True)
    batch = dict(x=x, y=y, state=state)

    def loss(params, batch):
        logits, _ = net.apply(params, batch["state"], None, batch["x"], is_training=True)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=1e-4, grad=6e-2), "bfloat16": Tol(loss=1e-4, grad=0.25)}
    return Model("hk.nets.ResNet18", "dm-haiku", params, {"padded": batch, "unpadded": batch}, loss, tol)


L, VOCAB, D, HEADS, LAYERS = 16, 64, 32, 4, 2


def _encoder(tokens, valid):
    x = hk.Embed(VOCAB, D)(tokens) + hk.get_parameter("pos", (L, D), init=hk.initializers.TruncatedNormal(0.02))
    mask = (valid[:, None, :, None] & valid[:, None, None, :]).astype(jnp.float32)  # (B, 1, Lq, Lk)
    init = hk.initializers.VarianceScaling(2 / LAYERS)
    for _ in range(LAYERS):
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        x = x + hk.MultiHeadAttention(num_heads=HEADS, key_size=D // HEADS, w_init=init)(h, h, h, mask=mask)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        x = x + hk.Linear(D, w_init=init)(jax.nn.gelu(hk.Linear(4 * D, w_init=init)(h)))
    return hk.Linear(VOCAB)(hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x))


def transformer() -> Model:
    net = hk.without_apply_rng(hk.transform(_encoder))
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    targets = jax.random.randint(jax.random.key(2), (B, L), 0, VOCAB)
    p = jnp.arange(L)
    valid = {"padded": jnp.stack([p >= 0, p < 11, p < 5, p < 1]), "unpadded": jnp.ones((B, L), bool)}
    batches = {k: dict(tokens=tokens, targets=targets, valid=v) for k, v in valid.items()}
    params = net.init(jax.random.key(0), tokens, valid["unpadded"])

    def loss(params, batch):
        logits = net.apply(params, batch["tokens"], batch["valid"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        w = batch["valid"].astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.sum(w)

    tol = {"float16": Tol(loss=1e-4, grad=5e-3), "bfloat16": Tol(loss=1e-3, grad=3e-2)}
    return Model("hk.MultiHeadAttention encoder", "dm-haiku", params, batches, loss, tol)


MODELS = {"resnet18": resnet18, "transformer": transformer}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_haiku(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
