"""``autocast.explain`` and ``autocast.find_overflow`` on the desktop ViT (the output quoted in docs/debugging.md).

1. ``explain`` of the desktop ViT loss (the shape ``bench_vit.py`` calls "desktop"): the
   table, the totals and the float32 matmuls (none), with the time it takes (trace only).
2. ``find_overflow`` on the same ViT: the forward pass of a batch with normalised pixels
   and of one whose pixels were not normalised (0..255), then the backward pass at loss
   scales 1 and 2**15 (``grad=True``), with the time each check takes.
3. A worked overflow hunt: a hand-written attention layer on unnormalised features
   (``hunt_model`` below), found, fixed with ``amp_stop``, checked again.

Run from the repo root::

    python -m benchmarks.overhead.explain_vit [--batch 8]

Results: ``benchmarks/results/overhead/explain_vit.{md,json,txt}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # allow `python benchmarks/overhead/explain_vit.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.overhead"

import jax
import jax.numpy as jnp

import autocast
from benchmarks import _common as C
from benchmarks.models.vit import SHAPES, ViT, loss_fn, synthetic_batch


def hunt_model(params, x):
    """Single-head attention written by hand on raw (unnormalised) features."""
    q = x @ params["wq"]
    k = x @ params["wk"]
    scores = q @ k.T  # (tokens, tokens): 64 products of large values
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.mean(weights @ (x @ params["wv"]))


def hunt_model_fixed(params, x):
    q = x @ params["wq"]
    k = x @ params["wk"]
    with autocast.amp_stop():
        scores = q @ k.T  # the fix: this product runs in float32
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.mean(weights @ (x @ params["wv"]))


def _hunt() -> list[tuple[str, str]]:
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    params = {n: jax.random.normal(k, (64, 64)) / 8.0 for n, k in zip(("wq", "wk", "wv"), keys)}
    x = jax.random.uniform(keys[3], (16, 64), maxval=255.0)  # raw 0..255 features
    steps = [
        ("float32 loss", str(hunt_model(params, x))),
        ("amp loss (float16)", str(autocast.amp(hunt_model)(params, x))),
        ("autocast.find_overflow(hunt_model)(params, x)", str(autocast.find_overflow(hunt_model)(params, x))),
        ("amp loss after the fix", str(autocast.amp(hunt_model_fixed)(params, x))),
        (
            "autocast.find_overflow(hunt_model_fixed)(params, x)",
            str(autocast.find_overflow(hunt_model_fixed)(params, x)),
        ),
        (
            "autocast.find_overflow(hunt_model_fixed, grad=True)(params, x)",
            str(autocast.find_overflow(hunt_model_fixed, grad=True)(params, x)),
        ),
        (
            "autocast.find_overflow(hunt_model_fixed, grad=True, scale=2.0**8)(params, x)",
            str(autocast.find_overflow(hunt_model_fixed, grad=True, scale=2.0**8)(params, x)),
        ),
    ]
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cfg = SHAPES["desktop"]
    model = ViT(cfg, key=jax.random.PRNGKey(0))
    x, y = synthetic_batch(cfg, args.batch, key=jax.random.PRNGKey(1))

    def loss(model, x, y):
        return loss_fn(model, x, y)[0]

    t0 = time.perf_counter()
    report = autocast.explain(loss)(model, x, y)
    t_explain = time.perf_counter() - t0
    text = str(report)

    hunts = []
    raw = jnp.round((x - x.min()) / (x.max() - x.min()) * 255.0)  # unnormalised pixels
    for title, kwargs, batch in (
        ("forward, normalised pixels", {}, x),
        ("forward, raw pixels 0..255", {}, raw),
        ("backward, loss scale 1", {"grad": True, "scale": 1.0}, x),
        ("backward, loss scale 2**15", {"grad": True, "scale": 2.0**15}, x),
    ):
        t0 = time.perf_counter()
        found = autocast.find_overflow(loss, **kwargs)(model, batch, y)
        hunts.append((title, kwargs, time.perf_counter() - t0, found))

    hunt = _hunt()
    meta = C.metadata()
    cmd = f"python -m benchmarks.overhead.explain_vit --batch {args.batch}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    md = [
        "# explain and find_overflow on the desktop ViT",
        "",
        f"Command: `{cmd}`",
        "",
        C.metadata_markdown(meta),
        f"Shared machine: load average {load:.1f} on {os.cpu_count()} cores when the run ended, so the times are noisy upper bounds.",
        "",
        f"## explain (trace only): {t_explain:.1f} s",
        "",
        "```",
        text,
        "```",
        "",
        "The same as markdown (`explanation.to_markdown()`):",
        "",
        report.to_markdown(),
        "",
        "## find_overflow",
        "",
        "Wall time of each call, in this order, in one process: the first call compiles every primitive it",
        "meets (JAX's per-primitive cache); later calls reuse those that recur.",
        "",
    ]
    for title, _kwargs, secs, found in hunts:
        md += [f"### {title}: {secs:.1f} s", "", "```", str(found), "```", ""]
    md += ["## A worked overflow hunt (`hunt_model` in benchmarks/overhead/explain_vit.py)", ""]
    for title, text_ in hunt:
        md += [f"`{title}`:", "", "```", text_, "```", ""]
    out = C.results_dir("overhead") / "explain_vit.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md))
    (C.results_dir("overhead") / "explain_vit.txt").write_text(text + "\n")
    C.write_json(
        C.results_dir("overhead") / "explain_vit.json",
        {
            "command": cmd,
            "meta": meta,
            "explain_seconds": t_explain,
            "explanation": report.to_dict(),
            "find_overflow": [
                {"title": t, "kwargs": k, "seconds": s, "findings": [f.__dict__ for f in found]}
                for t, k, s, found in hunts
            ],
        },
    )
    print("\n".join(md))


if __name__ == "__main__":
    main()
