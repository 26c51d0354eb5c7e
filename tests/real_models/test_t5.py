"""An encoder-decoder with relative position buckets: KerasHub's T5 on Keras 3's JAX backend,
under ``amp``.

``keras_hub.models.T5Seq2SeqLM`` around a tiny ``T5Backbone`` (no preprocessor), built from
config with random weights, in T5 v1.1's layout (gated-GELU feed-forward, RMS layer norm,
untied LM head), called as Keras documents for JAX training loops
(``model.stateless_call(trainable, non_trainable, inputs)``). T5 has no absolute
positions: each stack's first layer turns query-key offsets into buckets
(``_relative_position_bucket``: exact for small offsets, log-spaced up to a maximum
distance; bidirectional in the encoder, causal in the decoder) and learns a bias per bucket
and head, which all its layers share; the decoder cross-attends to the encoder.

T5 masks by adding ``(1 - mask) * -1e9`` to that position bias. The padded batch right-pads
two source rows (``encoder_padding_mask``), right-pads one target row and left-pads
another (``decoder_padding_mask``): the left-padded row's padding queries see only padding
keys (causal), so they are fully masked. The loss is the token cross-entropy over the
non-padding targets, the decoder reading the targets shifted right after a start token.

(Hugging Face's ``FlaxT5ForConditionalGeneration``, transformers 4.57.6, the last series
with Flax models, does not run on JAX 0.12: its ``_relative_position_bucket`` calls
``jnp.clip(..., a_max=...)``, a keyword JAX has removed.)
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks  # noqa: E402

B, SRC, TGT, VOCAB = 4, 16, 8, 64


def _batch(padded: bool) -> dict:
    k1, k2 = jax.random.split(jax.random.key(1))
    source = jax.random.randint(k1, (B, SRC), 2, VOCAB)
    targets = jax.random.randint(k2, (B, TGT), 2, VOCAB)
    src_mask, tgt_mask = jnp.ones((B, SRC), bool), jnp.ones((B, TGT), bool)
    if padded:
        p, q = jnp.arange(SRC), jnp.arange(TGT)
        src_mask = jnp.stack([p >= 0, p < 11, p >= 0, p < 5])  # rows 1 and 3 right-padded
        tgt_mask = jnp.stack([q >= 0, q < 6, q >= 3, q >= 0])  # row 1 right-, row 2 left-padded
    targets = jnp.where(tgt_mask, targets, 0)
    # decoder input t is target t-1 (the start token, 0, at the first real position); it is
    # real where target t is
    decoder_ids = jnp.where(tgt_mask, jnp.concatenate([jnp.zeros((B, 1), targets.dtype), targets[:, :-1]], 1), 0)
    return dict(
        inputs={
            "encoder_token_ids": jnp.where(src_mask, source, 0),
            "encoder_padding_mask": src_mask,
            "decoder_token_ids": decoder_ids,
            "decoder_padding_mask": tgt_mask,
        },
        targets=targets,
    )


def seq2seq_lm() -> keras.Model:
    """The tiny T5, float32, random weights (seed 0)."""
    assert keras.backend.backend() == "jax", keras.backend.backend()
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        key_value_dim=8,
        dropout=0.0,
        activation="gelu",
        use_gated_activation=True,
        tie_embedding_weights=False,
    )
    return keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)


def _weights(lm: keras.Model) -> list:
    """The trainable weights, the two embedding tables drawn from N(0, 1) instead of as built.

    KerasHub 0.32's ``T5Backbone`` initialises its token embeddings with
    ``keras.initializers.TruncatedNormal(1.0)``, whose first argument is the *mean*: every
    row is about 1.0 +- 0.05, one vector repeated. The gradient reaching the decoder through
    the LM head is then the small difference of nearly equal terms (the cross-entropy
    cotangent's rows sum to zero), which no half-precision cotangent of the logits keeps:
    with a token-mean loss, amp's bfloat16 gradient was 25 % off float32 (2.6 % with a
    power-of-two token count), MPX's recipe rounds the same cotangent. A checkpoint (or the
    intended standard deviation of 1) has no such common row; N(0, 1) is T5's own
    initialisation of its embeddings."""
    rng = np.random.default_rng(0)
    out = []
    for v in lm.trainable_variables:
        x = v.value
        if "embedding" in v.path and "attention" not in v.path:
            x = jnp.asarray(rng.standard_normal(np.shape(x)), jnp.float32)
        out.append(x)
    return out


def t5() -> Model:
    lm = seq2seq_lm()
    params = (_weights(lm), [v.value for v in lm.non_trainable_variables])

    def loss(params, batch):
        logits, _ = lm.stateless_call(params[0], params[1], batch["inputs"], training=False)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        w = batch["inputs"]["decoder_padding_mask"].astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.sum(w)

    batches = {"padded": _batch(True), "unpadded": _batch(False)}
    # Measured (CPU, JAX 0.12, 2026-11-27, `tests/real_models/measure.py t5`, the embeddings
    # drawn as `_weights` says; padded / unpadded): float16 loss 1.4e-4 / 1.1e-5, gradient
    # 1.9e-3 / 2.2e-3; bfloat16 loss 7.0e-5 / 3.2e-4, gradient 1.5e-2 / 1.6e-2. Tolerances
    # 3-5x those.
    tol = {"float16": Tol(loss=5e-4, grad=1e-2), "bfloat16": Tol(loss=1.5e-3, grad=6e-2)}
    return Model("T5Seq2SeqLM (T5 v1.1, tiny)", "keras-hub", params, batches, loss, tol)


MODELS = {"t5": t5}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_t5(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
