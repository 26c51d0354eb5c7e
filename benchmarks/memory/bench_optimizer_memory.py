"""Bytes per parameter of the parameters plus AdamW's state: float32 master vs bfloat16 + SR.

Measured from the pytrees themselves (every array leaf's shape and dtype, PRNG keys as their
key data), built with ``equinox.filter_eval_shape`` so ViT-Base needs no memory:

- ``float32 master``: float32 parameters, ``optax.adamw`` state (float32 moments, int32 count);
- ``bfloat16 + SR``: ``autocast.optim.to_half_params(model)``, ``autocast.optim.half_state(optax.adamw)``
  state (bfloat16 moments, int32 count, one PRNG key).

Models: ViT "desktop" and ViT-Base (``benchmarks/models/vit.py``), the character GPT of
``benchmarks/accuracy/char_gpt.py`` and a GPT-2-small-shaped one (d 768, 12 layers, vocabulary 50,257,
1,024 positions). Writes ``benchmarks/results/memory/optimizer_memory.{md,json}``::

    python -m benchmarks.memory.bench_optimizer_memory
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/memory/bench_optimizer_memory.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.memory"

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast
from benchmarks import _common as C
from benchmarks.models.char_gpt import GPT, GPTConfig
from benchmarks.models.vit import SHAPES, ViT

MODELS = {
    "ViT desktop": lambda: ViT(SHAPES["desktop"], key=jax.random.key(0)),
    "ViT-Base/16": lambda: ViT(SHAPES["base"], key=jax.random.key(0)),
    "char GPT (benchmarks/accuracy/char_gpt.py)": lambda: GPT(GPTConfig(), key=jax.random.key(0)),
    "GPT-2 small shape": lambda: GPT(
        GPTConfig(d_model=768, layers=12, heads=12, seq=1024, vocab=50257), key=jax.random.key(0)
    ),
}


def tree_bytes(tree: Any) -> int:
    """Bytes of the array leaves of an (abstract) pytree; PRNG keys count as their key data."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
        total += int(x.size) * jnp.dtype(x.dtype).itemsize
    return total


def measure(make) -> dict[str, Any]:
    model = eqx.filter_eval_shape(make)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    n = sum(int(x.size) for x in jax.tree.leaves(params))
    adamw = optax.adamw(1e-3)
    f32_state = jax.eval_shape(adamw.init, params)
    half_params = jax.eval_shape(autocast.optim.to_half_params, params)
    half_state = jax.eval_shape(autocast.optim.half_state(adamw).init, half_params)
    rows = {}
    for mode, (p, s) in {
        "float32 master": (params, f32_state),
        "bfloat16 + SR": (half_params, half_state),
    }.items():
        pb, sb = tree_bytes(p), tree_bytes(s)
        rows[mode] = {"params_bytes": pb, "opt_state_bytes": sb, "bytes_per_param": (pb + sb) / n}
    return {"parameters": n, "modes": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # no options: --help says what it measures and where it writes
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    meta = C.metadata()
    results = {name: measure(make) for name, make in MODELS.items()}
    lines = [
        "| model | parameters | float32 master: params + AdamW state | bytes/param | "
        "bfloat16 + SR: params + AdamW state | bytes/param | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        f, h = r["modes"]["float32 master"], r["modes"]["bfloat16 + SR"]
        lines.append(
            f"| {name} | {r['parameters']:,} | {C.fmt_bytes(f['params_bytes'])} + {C.fmt_bytes(f['opt_state_bytes'])} | "
            f"{f['bytes_per_param']:.4f} | {C.fmt_bytes(h['params_bytes'])} + {C.fmt_bytes(h['opt_state_bytes'])} | "
            f"{h['bytes_per_param']:.4f} | {f['bytes_per_param'] / h['bytes_per_param']:.3f}x |"
        )
    table = "\n".join(lines)
    print(table)
    cmd = "python -m benchmarks.memory.bench_optimizer_memory"
    C.write_json(C.results_dir("memory") / "optimizer_memory.json", {"command": cmd, "meta": meta, "results": results})
    (C.results_dir("memory") / "optimizer_memory.md").write_text(
        "## Optimizer memory: bytes per parameter of the parameters plus AdamW's state\n\n"
        f"Command: `{cmd}`\n\n{C.metadata_markdown(meta)}\n"
        "Measured from the pytrees (shapes and dtypes of every array leaf; the int32 step count "
        "and the 8-byte PRNG key of `half_state` are included, hence the digits after 12 and 6).\n\n"
        f"{table}\n"
    )
    return results


if __name__ == "__main__":
    main()
