"""Griffin (Google DeepMind's ``recurrentgemma`` package, its JAX implementation) under ``amp``.

A tiny ``GriffinConfig`` as the package's own ``griffin_test.py`` builds it: recurrent
blocks (a temporal Conv1D and the RG-LRU gated linear recurrence, run by ``lax.scan``:
``ScanType.LINEAR_NATIVE``, what ``AUTO`` picks off TPU; or by
``lax.associative_scan``: ``ASSOCIATIVE_NATIVE``) and a local-attention block, float32
parameters from ``Griffin.init``. The loss is the next-token cross-entropy over the
non-padding tokens.

Griffin takes no padding mask; its ``segment_pos`` restarts the recurrence and the
attention window where it is 0 (packed sequences). The padded batch packs two sequences
into one row, and right-pads two rows with token 0, which the loss masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks
from recurrentgemma import common
from recurrentgemma import jax as rg

B, L, VOCAB, WIDTH = 4, 16, 64, 32
RECURRENT, ATTENTION = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION


def _batch(padded: bool):
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    pos = jnp.tile(jnp.arange(L), (B, 1))
    if padded:
        p = jnp.arange(L)
        keep = jnp.stack([p >= 0, p >= 0, p < 11, p < 3])
        tokens = jnp.where(keep, tokens, 0)
        pos = pos.at[1].set(jnp.where(p < 7, p, p - 7))  # row 1: two packed sequences, 7 + 9 tokens
    return dict(tokens=tokens, segment_pos=pos)


def _griffin(scan_type) -> Model:
    config = common.GriffinConfig(
        vocab_size=VOCAB,
        width=WIDTH,
        mlp_expanded_width=3 * WIDTH,
        num_heads=2,
        lru_width=2 * WIDTH,
        block_types=(RECURRENT, RECURRENT, ATTENTION),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=4,
        logits_soft_cap=30.0,
        scan_type=scan_type,
    )
    model = rg.Griffin(config)
    batches = {"padded": _batch(True), "unpadded": _batch(False)}
    b = batches["unpadded"]
    params = model.init(jax.random.key(0), b["tokens"], b["segment_pos"])

    def loss(params, batch):
        tokens = batch["tokens"]
        logits, _ = model.apply(params, tokens, batch["segment_pos"], return_cache=False)
        labels = tokens[:, 1:]
        weights = ((labels != 0) & (batch["segment_pos"][:, 1:] != 0)).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
        return jnp.sum(ce * weights) / jnp.sum(weights)

    # Measured (CPU, JAX 0.12, benchmarks/results/corpus/real-models.md), both scans: float16 loss
    # 1.7e-4, gradient 1.1e-3; bfloat16 loss 2.1e-4, gradient 7.0e-3. About 5x margin.
    tol = {"float16": Tol(loss=1e-3, grad=5e-3), "bfloat16": Tol(loss=2e-3, grad=3e-2)}
    return Model(f"Griffin ({scan_type.name.lower()} scan)", "recurrentgemma", params, batches, loss, tol)


def griffin_linear() -> Model:
    return _griffin(common.ScanType.LINEAR_NATIVE)


def griffin_associative() -> Model:
    return _griffin(common.ScanType.ASSOCIATIVE_NATIVE)


MODELS = {"linear": griffin_linear, "associative": griffin_associative}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_griffin(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
