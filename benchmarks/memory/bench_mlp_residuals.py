"""Activation memory of a small MLP training step: float32 vs autocast (and variants).

Activation memory is the bytes of residuals ``jax.vjp`` saves for the backward pass that
are computed from the batch (backend independent; what mixed precision halves). Run::

    python -m benchmarks.memory.bench_mlp_residuals

Writes ``benchmarks/results/memory/mlp_residuals.{json,md}``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import autocast
from benchmarks import _common


def _params(key, sizes):
    keys = jax.random.split(key, len(sizes))
    return [
        {"w": jax.random.normal(k, (m, n)) * np.sqrt(2 / m), "b": jnp.zeros((n,))}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _mpx_style(dtype):
    """The MPX approach, re-implemented: cast every float input to half, rely on promotion."""

    def f(params, x, y):
        cast = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        return loss_fn(jax.tree_util.tree_map(cast, params), cast(x), y).astype(jnp.float32)

    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[784, 512, 512, 10])
    args = parser.parse_args()
    params = _params(jax.random.key(0), args.sizes)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.sizes[0]))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, args.sizes[-1])
    systems = {
        "fp32": loss_fn,
        # separates the two effects: precision, and recomputing elementwise intermediates
        "fp32 + jax.checkpoint(dots_saveable)": jax.checkpoint(loss_fn, policy=jax.checkpoint_policies.dots_saveable),
        "autocast f16": autocast.amp(loss_fn, compute_dtype=jnp.float16),
        "autocast bf16": autocast.amp(loss_fn, compute_dtype=jnp.bfloat16),
        "autocast f16, remat_float32=False": autocast.amp(loss_fn, remat_float32=False),
        "autocast f16, matmul_only policy": autocast.amp(loss_fn, amp_policy=autocast.load_policy("matmul_only")),
        "MPX approach f16 (re-implemented)": _mpx_style(jnp.float16),
    }
    rows = {}
    for name, f in systems.items():
        rows[name] = _common.residual_bytes(f, params, x, y)
    base = rows["fp32"]["activation"]
    meta = _common.metadata()
    lines = [
        "# MLP training step: activation memory (residuals saved for the backward pass)",
        "",
        _common.metadata_markdown(meta),
        "",
        f"MLP {args.sizes}, GELU, cross-entropy, batch {args.batch}. Command: `python -m benchmarks.memory.bench_mlp_residuals`",
        "",
        "| system | activation residuals | fp32 / system | by dtype |",
        "|---|---:|---:|---|",
    ]
    for name, r in rows.items():
        by = ", ".join(f"{k}: {_common.fmt_bytes(v)}" for k, v in sorted(r["activation_by_dtype"].items()))
        lines.append(f"| {name} | {_common.fmt_bytes(r['activation'])} | {base / r['activation']:.2f}x | {by} |")
    out = _common.results_dir("memory")
    _common.write_json(out / "mlp_residuals.json", {"meta": meta, "config": vars(args), "results": rows})
    (out / "mlp_residuals.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
