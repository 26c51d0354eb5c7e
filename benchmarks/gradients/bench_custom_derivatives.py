"""Custom-derivative activations and softmax cross-entropy under mixed precision.

Two measurements, side by side in one run:

1. Activation memory of an ``eqx.nn.MLP`` training step whose activation is a
   custom-derivative function (``jax.nn.relu``, ``relu6``, ``softplus``, ``mish``):
   residual bytes by dtype (residuals ``jax.vjp`` saves that are computed from the batch,
   as ``jax.ad_checkpoint.print_saved_residuals`` lists them) for float32, autocast f16 /
   bf16 and the MPX recipe (every float input cast to half, written here), plus the largest
   float32 residual.
2. The smallest per-example ``optax.softmax_cross_entropy_with_integer_labels`` over
   random, confident logits (an MLP with scaled inputs, labels = its argmax), in bf16 and
   f16. A cross-entropy is never negative.

Run::

    python -m benchmarks.gradients.bench_custom_derivatives

Writes ``benchmarks/results/gradients/custom_derivatives.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import print_saved_residuals

import autocast
from benchmarks import _common

ACTIVATIONS = {"relu": jax.nn.relu, "relu6": jax.nn.relu6, "softplus": jax.nn.softplus, "mish": jax.nn.mish}
_LINE = re.compile(r"^(\w+)\[([\d,]*)\]")


def _mpx_recipe(loss, dtype):
    """The MPX recipe, written here: cast every float input to half, cast the loss back."""

    def cast(a):
        return a.astype(dtype) if eqx.is_inexact_array(a) else a

    def f(params, x, y):
        return loss(jax.tree_util.tree_map(cast, params), cast(x), y).astype(jnp.float32)

    return f


def _largest_float32_residual(f, params, x, y) -> int:
    """Bytes of the largest float32 residual with a batch dimension (an activation; the
    batch size differs from every layer width, so weights do not count)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, params, x, y)
    largest = 0
    for line in out.getvalue().splitlines():
        m = _LINE.match(line.strip())
        if not m or m.group(1) != "f32" or "from the argument" in line:
            continue
        shape = [int(d) for d in m.group(2).split(",") if d]
        if not shape or shape[0] != x.shape[0]:
            continue
        n = int(np.prod(shape))
        largest = max(largest, 4 * n)
    return largest


def residual_table(args) -> dict:
    x = jax.random.normal(jax.random.key(1), (args.batch, args.in_size))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, args.classes)
    rows = {}
    for name, act in ACTIVATIONS.items():
        model = eqx.nn.MLP(args.in_size, args.classes, args.width, args.depth, activation=act, key=jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss(p, x, y, static=static):
            logits = jax.vmap(eqx.combine(p, static))(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        systems = {
            "float32": loss,
            "autocast f16": autocast.amp(loss, compute_dtype=jnp.float16),
            "autocast bf16": autocast.amp(loss, compute_dtype=jnp.bfloat16),
            "MPX recipe f16": _mpx_recipe(loss, jnp.float16),
            "MPX recipe bf16": _mpx_recipe(loss, jnp.bfloat16),
        }
        rows[name] = {}
        for sname, f in systems.items():
            r = _common.residual_bytes(f, params, x, y)
            r["largest_float32_residual"] = _largest_float32_residual(f, params, x, y)
            rows[name][sname] = r
    return rows


def min_cross_entropy(args) -> dict:
    rows = {}
    for dtype in ("bfloat16", "float16"):
        worst = {"autocast": np.inf, "float32": np.inf}
        for seed in range(args.ce_seeds):
            for scale in (1.0, 10.0, 30.0, 100.0, 300.0):
                k1, k2 = jax.random.split(jax.random.key(100 + seed))
                model = eqx.nn.MLP(64, 10, 256, 2, activation=jax.nn.relu, key=k1)
                x = jax.random.normal(k2, (4096, 64)) * scale
                labels = jnp.argmax(jax.vmap(model)(x), -1)
                params, static = eqx.partition(model, eqx.is_inexact_array)

                def per_example(p, x, y, static=static):
                    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(eqx.combine(p, static))(x), y)

                got = autocast.amp(per_example, compute_dtype=dtype)(params, x, labels)
                worst["autocast"] = min(worst["autocast"], float(jnp.min(got)))
                worst["float32"] = min(worst["float32"], float(jnp.min(per_example(params, x, labels))))
        rows[dtype] = worst
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--in-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--ce-seeds", type=int, default=4)
    args = parser.parse_args()
    if args.batch in (args.in_size, args.width, args.classes):
        parser.error(
            f"--batch={args.batch} must differ from the layer sizes (residuals are told apart by their batch dimension)"
        )
    meta = _common.metadata()
    residuals = residual_table(args)
    ce = min_cross_entropy(args)
    command = "python -m benchmarks.gradients.bench_custom_derivatives " + " ".join(sys.argv[1:])

    def fmt(n: float) -> str:
        return f"{n / 1024:,.1f} KiB"

    lines = [
        "# Custom-derivative activations and softmax cross-entropy",
        "",
        _common.metadata_markdown(meta),
        f"Command: `{command.strip()}`. Backend independent (residuals are read from the jaxpr).",
        "",
        "## Activation residuals of an `eqx.nn.MLP` training step",
        "",
        f"MLP {args.in_size} -> {args.depth} x {args.width} -> {args.classes}, batch {args.batch}, "
        "mean softmax cross-entropy. *Activation residuals*: bytes of the residuals saved for the "
        "backward pass that are computed from the batch. *Largest f32*: the largest float32 residual with a batch dimension "
        f"(an activation is {fmt(4 * args.batch * args.width)} in float32).",
        "",
        "| activation | system | activation residuals | by dtype | largest f32 |",
        "|---|---|---:|---|---:|",
    ]
    for name, systems in residuals.items():
        for sname, r in systems.items():
            by = ", ".join(f"{k}: {fmt(v)}" for k, v in sorted(r["activation_by_dtype"].items()))
            lines.append(f"| {name} | {sname} | {fmt(r['activation'])} | {by} | {fmt(r['largest_float32_residual'])} |")
    lines += [
        "",
        "## Smallest per-example softmax cross-entropy",
        "",
        f"`optax.softmax_cross_entropy_with_integer_labels` on the logits of a relu MLP (64 -> 2 x 256 -> 10) "
        f"for 4096 inputs scaled by 1, 10, 30, 100 and 300 (confident logits), labels = the argmax, "
        f"{args.ce_seeds} seeds. A cross-entropy is never negative.",
        "",
        "| compute dtype | min per-example loss, autocast | min, float32 |",
        "|---|---:|---:|",
    ]
    for dtype, r in ce.items():
        lines.append(f"| {dtype} | {r['autocast']:.3g} | {r['float32']:.3g} |")
    out = _common.results_dir("gradients")
    _common.write_json(
        out / "custom_derivatives.json",
        {
            "meta": meta,
            "command": command.strip(),
            "config": vars(args),
            "residuals": residuals,
            "min_cross_entropy": ce,
        },
    )
    (out / "custom_derivatives.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
