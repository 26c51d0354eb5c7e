"""KerasHub's T5 under ``amp``: the gradient's error against float32 as the loss weights change.

    JAX_PLATFORMS=cpu .venv-corpus/bin/python tests/real_models/repro_zero_loss_weights.py

The model and its inputs are test_t5.py's, unpadded, unchanged; only the per-target loss
weights differ. The gradient is linear in the weights, so weighting two targets 0.5 should
move amp's error about half as far as weighting them 0; it does not (see
docs/real-models.md's findings for the numbers): amp's gradient is far less accurate where
some weights are exactly 0.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import test_t5  # noqa: E402

import autocast  # noqa: E402
import conftest  # noqa: E402,F401  (XLA flags, Keras' JAX backend)


def main() -> None:
    lm = test_t5.seq2seq_lm()
    params = ([v.value for v in lm.trainable_variables], [v.value for v in lm.non_trainable_variables])
    batch = test_t5._batch(padded=False)

    def loss(params, batch):
        logits, _ = lm.stateless_call(params[0], params[1], batch["inputs"], training=False)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["w"]) / jnp.sum(batch["w"])

    ones = jnp.ones(batch["targets"].shape)
    cases = {
        "all weights 1": ones,
        "all weights 0.5": ones * 0.5,
        "row 1, targets 6, 7 at 0.5": ones.at[1, 6:].set(0.5),
        "row 1, targets 6, 7 at 0": ones.at[1, 6:].set(0.0),
        "row 0, targets 2, 5 at 0": ones.at[0, jnp.array([2, 5])].set(0.0),
    }

    def flat(tree):
        return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])

    print(f"jax {jax.__version__}, autocast from {os.path.dirname(autocast.__file__)}")
    for name, w in cases.items():
        b = dict(batch, w=w)
        ref = flat(jax.jit(jax.grad(loss))(params, b))
        errs = []
        for dtype in (jnp.float16, jnp.bfloat16):
            g = flat(jax.jit(jax.grad(autocast.amp(loss, compute_dtype=dtype)))(params, b))
            errs.append(f"{jnp.dtype(dtype).name} {np.linalg.norm(g - ref) / np.linalg.norm(ref):.2e}")
        print(f"{name:28} gradient rel. L2 error: {', '.join(errs)}", flush=True)


if __name__ == "__main__":
    main()
