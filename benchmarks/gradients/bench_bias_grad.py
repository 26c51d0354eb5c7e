"""Bias-gradient accuracy in bfloat16: autocast vs the MPX recipe, against float32.

A float32 bias broadcast over a large batch gets its gradient from a sum over the batch
(the transpose of the broadcast). autocast sums it in float32; the MPX recipe (cast every
float input to half, run the function) sums it in bfloat16. Cases: ``x @ w + b`` in jnp
(8192 rows), Equinox ``Linear`` / ``Conv2d`` and Flax ``Dense`` / ``Conv`` / ``DenseGeneral``,
each followed by another matmul and a softplus loss; and the whole gradient of a Flax CNN
(Conv -> GroupNorm -> relu -> Conv -> relu -> mean -> Dense) on a 32x16x16 batch. Run::

    python -m benchmarks.gradients.bench_bias_grad

Writes ``benchmarks/results/gradients/bias_grad.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
from benchmarks import _common

BF16 = jnp.bfloat16


def _rel(a, b) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree_util.tree_leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree_util.tree_leaves(b)])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _head(h, w2):
    return jnp.mean(jax.nn.softplus(h.reshape(h.shape[0], -1) @ w2))


def _keys(n):
    return jax.random.split(jax.random.key(0), n)


def jnp_dense(rows):
    k = _keys(4)
    p = {
        "w": jax.random.normal(k[0], (64, 64)) / 8,
        "b": jax.random.normal(k[1], (64,)),
        "w2": jax.random.normal(k[2], (64, 8)) / 8,
    }
    x = jax.random.normal(k[3], (rows, 64))
    return (lambda p, x: _head(x @ p["w"] + p["b"], p["w2"])), p, x, lambda g: g["b"]


def eqx_linear(rows):
    k = _keys(3)
    lin = eqx.nn.Linear(64, 64, key=k[0])
    w2 = jax.random.normal(k[1], (64, 8)) / 8
    x = jax.random.normal(k[2], (rows, 64))
    return (lambda m, x: _head(jax.vmap(m)(x), w2)), lin, x, lambda g: g.bias


def eqx_conv(batch):
    k = _keys(3)
    conv = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k[0])
    w2 = jax.random.normal(k[1], (16 * 16 * 16, 4)) / 64
    x = jax.random.normal(k[2], (batch, 8, 16, 16))
    return (lambda m, x: _head(jax.vmap(m)(x), w2)), conv, x, lambda g: g.bias


def _flax(module, x_shape, feat):
    k = _keys(3)
    x = jax.random.normal(k[0], x_shape)
    params = module.init(k[1], x)
    w2 = jax.random.normal(k[2], (feat, 4)) / np.sqrt(feat)
    return (lambda p, x: _head(module.apply(p, x), w2)), params, x, lambda g: g["params"]["bias"]


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(16, (3, 3))(x)))
        x = nn.relu(nn.Conv(16, (3, 3))(x)).mean(axis=(1, 2))
        return nn.Dense(10)(x)


def flax_cnn(batch):
    k = _keys(3)
    x = jax.random.normal(k[0], (batch, 16, 16, 3))
    y = jax.random.randint(k[1], (batch,), 0, 10)
    model = CNN()
    params = model.init(k[2], x)

    def loss(p, x):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    return loss, params, x, lambda g: g


def _mpx_style(loss):
    """The MPX recipe, re-implemented: every float input cast to half, loss back to float32."""

    def f(p, x):
        cast = lambda a: a.astype(BF16) if eqx.is_array(a) and jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        return loss(jax.tree_util.tree_map(cast, p), cast(x)).astype(jnp.float32)

    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default="bias_grad")
    args = parser.parse_args()
    cases = {
        f"jnp x @ w + b ({args.rows} rows)": jnp_dense(args.rows),
        f"eqx Linear ({args.rows} rows)": eqx_linear(args.rows),
        f"eqx Conv2d ({args.batch}x16x16)": eqx_conv(args.batch),
        f"flax Dense ({args.rows} rows)": _flax(nn.Dense(64), (args.rows, 64), 64),
        f"flax Conv ({args.batch}x16x16)": _flax(nn.Conv(16, (3, 3)), (args.batch, 16, 16, 8), 16 * 16 * 16),
        f"flax DenseGeneral ({args.rows} rows)": _flax(nn.DenseGeneral((4, 16), axis=-1), (args.rows, 64), 64),
        f"flax CNN, whole gradient ({args.batch}x16x16)": flax_cnn(args.batch),
    }
    rows = {}
    for name, (loss, params, x, pick) in cases.items():
        ref = pick(jax.jit(jax.grad(loss))(params, x))
        rows[name] = {
            "autocast": _rel(pick(jax.jit(jax.grad(autocast.amp(loss, compute_dtype=BF16)))(params, x)), ref),
            "mpx_style": _rel(pick(jax.jit(jax.grad(_mpx_style(loss)))(params, x)), ref),
        }
        print(name, rows[name], flush=True)
    meta = _common.metadata()
    command = "python -m benchmarks.gradients.bench_bias_grad " + " ".join(sys.argv[1:])
    _common.write_json(
        _common.results_dir("gradients") / f"{args.out}.json",
        {"command": command, "args": vars(args), "metadata": meta, "results": rows},
    )
    lines = [
        "# Bias-gradient accuracy in bfloat16 (relative L2 error against float32)\n",
        f"Command: `{command}`\n",
        _common.metadata_markdown(meta),
        "Bias gradient of each layer (last row: every leaf of the CNN's gradient together); "
        "autocast = `jax.grad(amp(loss, compute_dtype=bfloat16))`; MPX recipe = every float "
        "input cast to bfloat16 (re-implemented). Deterministic (no timing).\n",
        "| case | autocast bf16 | MPX recipe bf16 |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {r['autocast']:.1e} | {r['mpx_style']:.1e} |" for name, r in rows.items()]
    text = "\n".join(lines) + "\n"
    (_common.results_dir("gradients") / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
