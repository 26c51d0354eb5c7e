"""Overhead of the ``autocast.amp`` transform itself, for ViTs of growing depth.

For each depth (desktop ViT width 256 / MLP 800 / 8 heads, so the jaxpr grows with the
number of blocks) it measures, with fresh function objects every repetition (no cache
hits) and the variants interleaved:

- trace / lower / compile time of ``jax.jit(step)`` (fp32 training step: forward,
  backward, AdamW update), ``jax.jit(amp(step))`` (the whole step transformed),
  ``jax.jit(step')`` where ``step'`` differentiates ``amp(loss)`` (the usual way to use
  ``amp`` in training), and, as a control, the step with MPX-style casts of params and
  batch to half (what XLA needs to compile a half-precision program, with no transform);
- eager cost of ``g = amp(loss)``: the first call (traces ``loss`` and evaluates the
  transformed jaxpr), the second call with the same shapes (must not retrace; the script
  counts how often the Python function runs), against calling ``loss`` eagerly.

Run from the repo root::

    python -m benchmarks.overhead.bench_overhead            # depths 1 3 6 12
    python -m benchmarks.overhead.bench_overhead --quick    # depths 1 3, one repetition

Results go to ``benchmarks/results/overhead/overhead[_quick].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/overhead/bench_overhead.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.overhead"

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast
from benchmarks import _common as C
from benchmarks.models.vit import SHAPES, ViT, loss_fn, synthetic_batch

VARIANTS = ("jit(step)", "jit(amp(step))", "jit(step with amp(loss))", "jit(step, MPX-style casts)")


def _make(variant: str, static, opt, dtype):
    """A fresh jitted step for ``variant`` (new function objects: no trace-cache hits)."""

    def loss(params, x, y):
        return loss_fn(eqx.combine(params, static), x, y)

    inner = loss if variant != VARIANTS[2] else autocast.amp(loss, compute_dtype=dtype)

    def step(params, opt_state, x, y):
        if variant == VARIANTS[3]:  # control: a half-precision program without the transform
            half = lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a  # noqa: E731
            (l, _), g = jax.value_and_grad(inner, has_aux=True)(jax.tree_util.tree_map(half, params), half(x), y)
            g = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), g)
        else:
            (l, _), g = jax.value_and_grad(inner, has_aux=True)(params, x, y)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, l

    if variant == VARIANTS[1]:
        step = autocast.amp(step, compute_dtype=dtype)
    return jax.jit(step)


def measure_depth(depth: int, *, batch: int, repeats: int, dtype) -> dict[str, Any]:
    """Compile-time stages per variant and the eager per-call costs at one depth."""
    cfg = dataclasses.replace(SHAPES["desktop"], depth=depth)
    model = ViT(cfg, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    x, y = synthetic_batch(cfg, batch, key=jax.random.key(1))
    args = (params, opt_state, x, y)

    def _plain_step(p, o, x, y):
        (l, _), g = jax.value_and_grad(lambda q: loss_fn(eqx.combine(q, static), x, y), has_aux=True)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, l

    n_eqns = C.count_eqns(jax.make_jaxpr(_plain_step)(*args))
    stages: dict[str, dict[str, list[float]]] = {
        v: {"trace": [], "lower": [], "compile": [], "total": [], "total_cpu": []} for v in VARIANTS
    }
    for _ in range(repeats):
        for v in VARIANTS:  # interleaved
            _, t = C.trace_lower_compile(_make(v, static, opt, dtype), *args)
            for k in stages[v]:
                stages[v][k].append(t[k])
    med = {v: {k: statistics.median(ts) for k, ts in st.items()} for v, st in stages.items()}

    # eager: amp(loss) called twice with the same shapes, against loss itself
    calls = {"n": 0}

    def counted_loss(model, x, y):
        calls["n"] += 1
        return loss_fn(model, x, y)

    g = autocast.amp(counted_loss, compute_dtype=dtype)
    t_first, _ = C.timed(lambda: g(model, x, y))
    traces_after_first = calls["n"]
    t_second, _ = C.timed(lambda: g(model, x, y))
    traces_after_second = calls["n"]
    t_plain = min(C.timed(lambda: loss_fn(model, x, y))[0] for _ in range(2))
    return {
        "depth": depth,
        "n_eqns": n_eqns,
        "stages_s": med,
        "ratio_trace_compile": {v: med[v]["total"] / med[VARIANTS[0]]["total"] for v in VARIANTS[1:]},
        "ratio_trace": {v: med[v]["trace"] / med[VARIANTS[0]]["trace"] for v in VARIANTS[1:]},
        "ratio_trace_compile_cpu": {v: med[v]["total_cpu"] / med[VARIANTS[0]]["total_cpu"] for v in VARIANTS[1:]},
        "eager": {
            "amp_first_call_s": t_first,
            "amp_second_call_s": t_second,
            "plain_call_s": t_plain,
            "python_calls_after_first": traces_after_first,
            "python_calls_after_second": traces_after_second,
            "second_call_retraced": traces_after_second > traces_after_first,
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", help="ViT depths (default 1 3 6 12)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, help="repetitions per variant (default 2)")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--quick", action="store_true", help="depths 1 3, one repetition")
    args = ap.parse_args(argv)
    depths = args.depths or ([1, 3] if args.quick else [1, 3, 6, 12])
    repeats = args.repeats or (1 if args.quick else 2)
    dtype = jnp.dtype(args.dtype)
    meta = C.metadata()
    cmd = "python -m benchmarks.overhead.bench_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"bench_overhead: depths={depths} repeats={repeats} backend={meta['backend']}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for d in depths:
        r = measure_depth(d, batch=args.batch, repeats=repeats, dtype=dtype)
        rows.append(r)
        print(
            f"  depth {d}: {r['n_eqns']} eqns, trace+lower+compile ratio wall/cpu "
            + ", ".join(
                f"{v} {x:.2f}/{r['ratio_trace_compile_cpu'][v]:.2f}" for v, x in r["ratio_trace_compile"].items()
            ),
            flush=True,
        )
    wall = time.perf_counter() - t0
    stem = "overhead" + ("_quick" if args.quick else "")
    out = C.results_dir("overhead")
    C.write_json(
        out / f"{stem}.json",
        {
            "command": cmd,
            "meta": meta,
            "batch": args.batch,
            "repeats": repeats,
            "dtype": args.dtype,
            "wall_s": wall,
            "results": rows,
        },
    )
    a, b, c, d = VARIANTS
    md = [
        f"## Overhead of `amp` (desktop ViT, growing depth, {args.dtype})\n",
        f"Command: `{cmd}` ({wall:.0f} s wall)\n",
        C.metadata_markdown(meta),
        f"Medians of {repeats} interleaved repetitions, fresh function objects each time. "
        f"`{b}` transforms the whole training step (forward, backward, AdamW); `{c}` "
        f"differentiates `amp(loss)`; `{d}` is a control without the transform. Ratios "
        f"are against `{a}`: trace+lower+compile wall time, then in brackets the same in "
        "process CPU time (robust to other load on a shared machine) and trace time "
        "alone.\n",
        f"| depth | eqns in step | `{a}` trace / lower / compile (s) | `{b}` trace / lower / "
        f"compile (s) | ratio wall (CPU; trace) | `{c}` trace / lower / compile (s) | ratio "
        f"wall (CPU; trace) | `{d}` trace / lower / compile (s) | ratio wall (CPU; trace) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def tlc(s):
        return f"{s['trace']:.2f} / {s['lower']:.2f} / {s['compile']:.2f}"

    for r in rows:
        st = r["stages_s"]
        rt, rc, rp = r["ratio_trace"], r["ratio_trace_compile"], r["ratio_trace_compile_cpu"]
        md.append(
            f"| {r['depth']} | {r['n_eqns']} | {tlc(st[a])} | "
            + " | ".join(f"{tlc(st[v])} | **{rc[v]:.2f}** ({rp[v]:.2f}; {rt[v]:.2f})" for v in (b, c, d))
            + " |"
        )
    md += [
        f"\nEager calls of `g = amp(loss)` (forward only, batch {args.batch}) against `loss` itself:\n",
        "| depth | first call | second call | plain `loss` | second / plain | "
        "Python calls of `loss` after 1st / 2nd | retraced on 2nd call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["eager"]
        md.append(
            f"| {r['depth']} | {e['amp_first_call_s'] * 1e3:.0f} ms | "
            f"{e['amp_second_call_s'] * 1e3:.0f} ms | {e['plain_call_s'] * 1e3:.0f} ms | "
            f"{e['amp_second_call_s'] / e['plain_call_s']:.2f} | "
            f"{e['python_calls_after_first']} / {e['python_calls_after_second']} | "
            f"{'yes' if e['second_call_retraced'] else 'no'} |"
        )
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    _plot(rows, out / f"{stem}.png")
    print("\n".join(md))
    print(f"\nwrote {out / stem}.{{json,md,png}} in {wall:.0f} s")


def _plot(rows: list[dict[str, Any]], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    n = [r["n_eqns"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in VARIANTS:
        ax1.plot(n, [r["stages_s"][v]["total"] for r in rows], "o-", label=v)
    for v in VARIANTS[1:]:
        ax2.plot(n, [r["ratio_trace_compile"][v] for r in rows], "o-", label=v)
    ax1.set(
        xlabel="equations in the training step's jaxpr", ylabel="trace+lower+compile (s)", title="Compile-time cost"
    )
    ax2.axhline(1.3, color="grey", ls="--", lw=1, label="target 1.3")
    ax2.set(xlabel="equations in the training step's jaxpr", ylabel="ratio to jit(step)", title="Overhead ratio")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
