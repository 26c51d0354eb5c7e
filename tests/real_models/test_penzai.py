"""Penzai (Google DeepMind's named-axis neural network library) under ``amp``: its
Llama-like transformer family (``penzai.models.transformer.variants.llamalike_common``),
built from a config with random parameters, in two configurations:

- Llama-style (one block): SwiGLU, grouped-query attention (two KV heads, two query heads each),
  untied embeddings, global causal attention;
- Gemma 2-style (the ``gemma2_*`` presets of ``variants/gemma.py``, tiny): GeGLU, tied and
  rescaled embeddings, post-attention and post-FFW norms, attention-logit and final-logit
  tanh soft caps, a sliding-window layer (window 4) and a global one.

Every array is a named array (``pz.nx``): einsums by axis name, and the causal mask is
applied as ``nmap(jnp.where)(mask, logits, masked_out_value)``, where
``masked_out_value`` is a float32 array (-2.38e38) held as a pytree field of the
``ApplyCausalAttentionMask`` layer. Training as penzai's documentation does it:
``pz.unbind_params(model, freeze=True)``, and the loss binds the parameter values back.

Penzai masks a key whose token position is negative (``kv_positions >= 0``). The padded
batch pads one row on the right and one on the left with position -1: a padding query
row (position -1) sees no key at all, so it is fully masked. The loss is next-token
cross-entropy over the non-padding tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks
from penzai import pz
from penzai.models.transformer.variants import llamalike_common as ll

B, L, VOCAB = 4, 16, 64


def _batch(padded: bool) -> dict:
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    keep = jnp.ones((B, L), bool)
    if padded:
        p = jnp.arange(L)
        keep = jnp.stack([p >= 0, p < 11, p >= 6, p < 3])  # full, right-padded, left-padded, short
    positions = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, -1)
    return dict(tokens=jnp.where(keep, tokens, 0), positions=positions, keep=keep)


def _transformer(name: str, config: ll.LlamalikeTransformerConfig, tol: dict[str, Tol]) -> Model:
    model = ll.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    unbound, params = pz.unbind_params(model, freeze=True)

    def loss(params, batch):
        lm = pz.bind_variables(unbound, params)
        tokens = pz.nx.wrap(batch["tokens"]).tag("batch", "seq")
        positions = pz.nx.wrap(batch["positions"]).tag("batch", "seq")
        logits = lm(tokens, token_positions=positions).unwrap("batch", "seq", "vocabulary")
        labels, keep = batch["tokens"][:, 1:], batch["keep"]
        weights = (keep[:, :-1] & keep[:, 1:]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
        return jnp.sum(ce * weights) / jnp.sum(weights)

    batches = {"padded": _batch(True), "unpadded": _batch(False)}
    return Model(name, "penzai", params, batches, loss, tol)


def llama() -> Model:
    config = ll.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=128,
        num_decoder_blocks=1,
        vocab_size=VOCAB,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    return _transformer("Llama-like (penzai, tiny)", config, _TOLERANCES["llama"])


def gemma2() -> Model:
    config = ll.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=128,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=True,
        attention_type=(ll.AttentionTypeSlidingWindowCausal(4), ll.AttentionTypeGlobalCausal()),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
    )
    return _transformer("Gemma 2-like (penzai, tiny)", config, _TOLERANCES["gemma2"])


# Measured (CPU, JAX 0.12, 2026-11-27, `tests/real_models/measure.py penzai`; loss relative
# error, gradient relative L2 error, padded / unpadded). At 7e5ce21:
#   Llama-like  float16  2.8e-5 / 4.2e-5, NaN / 1.3e-3;  bfloat16 1.0e-4 / 2.7e-4, 9.3e-3 / 1.1e-2
#   Gemma 2     float16  NaN / 5.8e-5, NaN / 2.0e-3;     bfloat16 3.4e-4 / 1.5e-4, 1.4e-2 / 1.5e-2
# The padded batch's gradient (and Gemma 2's loss) is NaN in float16: issue 42's bug (2),
# the float32 `masked_out_value` array (-2.38e38) becomes -inf and the fully masked query
# rows' softmax NaN. With the fix in progress in the working tree (same day) the padded float16 errors
# are those of the unpadded batch: Llama-like 2.8e-5, 1.2e-3; Gemma 2 2.7e-5, 1.7e-3.
# Tolerances: 3-5x the largest measured.
_TOLERANCES = {
    "llama": {"float16": Tol(loss=2e-4, grad=5e-3), "bfloat16": Tol(loss=1e-3, grad=4e-2)},
    "gemma2": {"float16": Tol(loss=3e-4, grad=8e-3), "bfloat16": Tol(loss=1.5e-3, grad=5e-2)},
}

MODELS = {"llama": llama, "gemma2": gemma2}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_penzai(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
