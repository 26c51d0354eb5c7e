"""KerasHub backbones on Keras 3's JAX backend under ``amp``.

Built from config with random weights (no presets, nothing downloaded), float32 (Keras'
default dtype policy), and called functionally as Keras documents for JAX training loops:
``model.stateless_call(trainable_values, non_trainable_values, inputs)``, so ``amp`` and
``jax.value_and_grad`` see a pure function of the variables' values.

- ``keras_hub.models.BertBackbone``: bidirectional encoder; ``padding_mask`` masks keys.
  A row that is all padding has every query fully masked.
- ``keras_hub.models.GPT2CausalLM`` around a ``GPT2Backbone`` (no preprocessor): causal
  decoder with tied embeddings; the padded batch pads one row on the left, so its padded
  query rows (causal: they see only earlier, padded keys) are fully masked.
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

B, L, VOCAB, HIDDEN = 4, 16, 64, 32


def _stateless(model: keras.Model):
    """The model's variables as a pytree of arrays, and a pure function of them."""
    assert keras.backend.backend() == "jax", keras.backend.backend()
    params = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])

    def apply(params, inputs):
        outputs, _ = model.stateless_call(params[0], params[1], inputs, training=False)
        return outputs

    return params, apply


def _inputs(padded: bool, rows):
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    mask = jnp.ones((B, L), bool)
    if padded:
        p = jnp.arange(L)
        mask = jnp.stack([r(p) for r in rows])
        tokens = jnp.where(mask, tokens, 0)
    return {"token_ids": tokens, "padding_mask": mask}


def bert() -> Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=HIDDEN,
        intermediate_dim=64,
        max_sequence_length=L,
        dropout=0.0,
    )
    params, apply = _stateless(backbone)
    rows = (lambda p: p >= 0, lambda p: p < 11, lambda p: p < 3, lambda p: p < 0)  # the last: all padding
    batches = {"padded": _inputs(True, rows), "unpadded": _inputs(False, rows)}
    batches = {k: dict(v, segment_ids=jnp.zeros((B, L), jnp.int32)) for k, v in batches.items()}
    target = jax.random.normal(jax.random.key(2), (B, L, HIDDEN))

    def loss(params, inputs):
        out = apply(params, inputs)
        w = inputs["padding_mask"][..., None].astype(jnp.float32)
        seq = jnp.sum(w * (out["sequence_output"] - target) ** 2) / (jnp.sum(w) * HIDDEN)
        return seq + jnp.mean(out["pooled_output"] ** 2)

    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=1e-5, grad=5e-4), "bfloat16": Tol(loss=1e-5, grad=2e-3)}
    return Model("BertBackbone (tiny)", "keras-hub", params, batches, loss, tol)


def gpt2() -> Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=HIDDEN,
        intermediate_dim=64,
        max_sequence_length=L,
        dropout=0.0,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    params, apply = _stateless(lm)
    rows = (lambda p: p >= 0, lambda p: p < 11, lambda p: p >= 6, lambda p: p < 3)  # row 2: left-padded
    batches = {"padded": _inputs(True, rows), "unpadded": _inputs(False, rows)}

    def loss(params, inputs):
        logits = apply(params, inputs)
        tokens, mask = inputs["token_ids"], inputs["padding_mask"]
        weights = (mask[:, :-1] & mask[:, 1:]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return jnp.sum(ce * weights) / jnp.sum(weights)

    tol = {"float16": Tol(loss=5e-5, grad=4e-3), "bfloat16": Tol(loss=5e-5, grad=3e-2)}
    return Model("GPT2CausalLM (tiny)", "keras-hub", params, batches, loss, tol)


MODELS = {"bert": bert, "gpt2": gpt2}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_keras_hub(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
