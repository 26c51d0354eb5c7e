"""Gemma 3 (Google DeepMind's ``gemma`` package, ``gm.nn.Transformer``) under ``amp``.

A tiny Gemma 3 configuration with the architecture of ``gm.nn.Gemma3_1B`` (QK norm, post
attention and post FFW norms, grouped-query attention, a sliding-window layer and a global
one, two RoPE frequencies), built as the package builds its own test model
(``gm.testing.DummyGemma``: a ``TransformerConfig``), float32 parameters from
``model.init``. The loss is the next-token cross-entropy over the non-padding tokens.

Gemma builds its mask from the tokens (``0`` is padding): causal, padding keys masked,
and the sliding window in local layers. The padded batch pads one sequence on the right
and one on the left: a left-padded query row sees only padding keys, so it is fully
masked (its scores are all ``K_MASK``, float32 gives it a uniform softmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from gemma import gm
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

B, L, VOCAB = 4, 16, 64
LOCAL, GLOBAL = gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL

CONFIG = gm.nn.config.TransformerConfig(
    final_logit_softcap=None,
    num_embed=VOCAB,
    embed_dim=64,
    hidden_dim=128,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    use_qk_norm=True,
    attention_types=(LOCAL, GLOBAL),  # Gemma 3 interleaves 5 local : 1 global; one of each here
    query_pre_attn_norm=gm.nn.config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
    attn_logits_soft_cap=None,
    sliding_window_size=4,
    transpose_gating_einsum=True,
    local_base_frequency=10_000,
    global_base_frequency=1_000_000,
    vision_encoder=None,
)


def _tokens(padded: bool):
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    if padded:
        pos = jnp.arange(L)
        keep = jnp.stack([pos >= 0, pos < 11, pos >= 6, pos < 3])  # full, right-padded, left-padded, short
        tokens = jnp.where(keep, tokens, 0)
    return tokens


def gemma3() -> Model:
    model = gm.nn.Transformer(config=CONFIG, dtype=jnp.float32)
    batches = {"padded": _tokens(True), "unpadded": _tokens(False)}
    params = model.init(jax.random.key(0), batches["unpadded"])

    def loss(params, tokens):
        logits = model.apply(params, tokens).logits  # (B, L, VOCAB)
        labels = tokens[:, 1:]
        weights = ((tokens[:, :-1] != 0) & (labels != 0)).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
        return jnp.sum(ce * weights) / jnp.sum(weights)

    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=1e-4, grad=5e-3), "bfloat16": Tol(loss=1e-4, grad=4e-2)}
    return Model("Gemma 3 (tiny)", "gemma", params, batches, loss, tol)


MODELS = {"gemma3": gemma3}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_gemma(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
