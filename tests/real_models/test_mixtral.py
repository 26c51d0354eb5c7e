"""A mixture-of-experts language model: KerasHub's Mixtral on Keras 3's JAX backend, under ``amp``.

``keras_hub.models.MixtralCausalLM`` around a tiny ``MixtralBackbone`` (no preprocessor),
built from config with random weights, called as Keras documents for JAX training loops:
``model.stateless_call(trainable, non_trainable, inputs, training=True, return_losses=True)``.

Each decoder layer's ``MixtralSparseMoeBlock`` routes every token to its top 2 of 4
experts (a router ``Dense``, softmax, ``top_k``, renormalised gates, one-hot dispatch into
a batched expert bank of SwiGLU FFNs) and, in training, adds the Switch-style
load-balancing loss (``compute_load_balancing_loss``: expert token fractions times mean
router probabilities over the non-padding tokens) with ``add_loss``; ``return_losses``
returns it, and the loss is next-token cross-entropy plus those auxiliary losses.
Attention: grouped-query, RoPE, a sliding window of 8.

The padded batch pads one row on the right and one on the left (``padding_mask``): the
left-padded row's padding queries see only padding keys (causal), so they are fully
masked; the padding tokens are also left out of the load-balancing statistics.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks  # noqa: E402

B, L, VOCAB = 4, 16, 64


def _inputs(padded: bool) -> dict:
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    mask = jnp.ones((B, L), bool)
    if padded:
        p = jnp.arange(L)
        mask = jnp.stack([p >= 0, p < 11, p >= 6, p < 3])  # full, right-padded, left-padded, short
    return {"token_ids": jnp.where(mask, tokens, 0), "padding_mask": mask}


def mixtral() -> Model:
    assert keras.backend.backend() == "jax", keras.backend.backend()
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        num_key_value_heads=2,
        num_experts=4,
        top_k=2,
        sliding_window=8,
    )
    lm = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    params = ([v.value for v in lm.trainable_variables], [v.value for v in lm.non_trainable_variables])

    def loss(params, inputs):
        logits, _, aux = lm.stateless_call(params[0], params[1], inputs, training=True, return_losses=True)
        assert len(aux) == backbone.num_layers, aux  # one load-balancing loss per MoE layer
        tokens, mask = inputs["token_ids"], inputs["padding_mask"]
        weights = (mask[:, :-1] & mask[:, 1:]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return jnp.sum(ce * weights) / jnp.sum(weights) + sum(aux)

    batches = {"padded": _inputs(True), "unpadded": _inputs(False)}
    # Measured (CPU, JAX 0.12, 2026-11-27, `tests/real_models/measure.py mixtral`; padded /
    # unpadded): float16 loss 4.6e-7 / 3.4e-7, gradient 9.5e-4 / 1.0e-3; bfloat16 loss
    # 8.6e-6 / 1.1e-5, gradient 7.8e-3 / 8.5e-3. Tolerances 3-5x those.
    tol = {"float16": Tol(loss=2e-6, grad=5e-3), "bfloat16": Tol(loss=5e-5, grad=3e-2)}
    return Model("MixtralCausalLM (MoE, tiny)", "keras-hub", params, batches, loss, tol)


MODELS = {"mixtral": mixtral}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_mixtral(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
