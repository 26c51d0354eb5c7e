"""Train a small ViT on scikit-learn's handwritten digits: float32 vs autocast f16 and bf16.

The dataset ships with scikit-learn (1,797 8x8 images, no download). The same model,
initialisation and batch order are trained three times:

- ``fp32``: plain float32;
- ``amp-f16``: ``autocast.amp(loss, compute_dtype=float16)`` with the dynamic loss scaler;
- ``amp-bf16``: ``autocast.amp(loss, compute_dtype=bfloat16)`` (no loss scaling needed).

Then it prints a table (final train loss, test accuracy, median step time, activation
memory, skipped steps, final loss scale) and writes the loss curves and the loss scale to
``benchmarks/results/demo.png`` (plus ``demo.json`` and ``demo.md``). Runs on CPU in a
few minutes and unchanged on a GPU. From the repo root::

    pip install -e ".[demo]"
    python -m benchmarks.demo            # or: python benchmarks/demo.py
    python -m benchmarks.demo --steps 300   # a shorter run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/demo.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
from benchmarks import _common as C
from benchmarks.vit import ViT, ViTConfig, loss_fn

#: The demo model: 8x8 grey images, 2x2 patches (16 tokens + cls), width 64, 4 blocks.
DIGITS_VIT = ViTConfig(image_size=8, channels=1, patch=2, width=64, mlp_hidden=128, depth=4,
                       heads=4, classes=10, pool="cls")

RUNS = {
    "fp32": None,
    "amp-f16": jnp.float16,
    "amp-bf16": jnp.bfloat16,
}


def load_digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Digits as float32 ``(N, 1, 8, 8)`` standardised images; stratified 80/20 split."""
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    data = _load()
    x = (data.images.astype(np.float32) / 16.0)[:, None]
    y = data.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed,
                                              stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, ncols=100, leave=True)
    except ImportError:  # tqdm is optional: fall back to a line every 10 %

        class _Bar:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                if self.n % max(1, total // 10) == 0 or self.n == total:
                    print(f"{desc}: {self.n}/{total}", flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Bar()


def _make_step(static, opt, dtype):
    """A jitted train step ``(params, opt_state, scaler, x, y) -> (..., loss, finite)``."""
    if dtype is None:

        def step(params, opt_state, scaler, x, y):
            (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
                eqx.combine(params, static), x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, scaler, loss, True

        return jax.jit(step)

    grad_fn = autocast.dynamic_scale_value_and_grad(
        autocast.amp(loss_fn, compute_dtype=dtype), has_aux=True)

    def step(params, opt_state, scaler, x, y):
        model = eqx.combine(params, static)
        scaler, ((loss, _), grads) = grad_fn(model, x, y, dynamic_scaler_state=scaler)
        model, opt_state = autocast.optimizer_update(model, opt, opt_state, grads,
                                                     scaler.grads_finite)
        return eqx.filter(model, eqx.is_array), opt_state, scaler, loss, scaler.grads_finite

    return jax.jit(step)


def _make_eval(static, dtype):
    """Jitted ``(params, x, y) -> (sum of losses, number correct)`` in the run's precision."""
    f = loss_fn if dtype is None else autocast.amp(loss_fn, compute_dtype=dtype)

    @jax.jit
    def evaluate(params, x, y):
        loss, acc = f(eqx.combine(params, static), x, y)
        return loss * x.shape[0], acc * x.shape[0]

    return evaluate


def _evaluate(evaluate, params, x, y, batch: int = 512) -> tuple[float, float]:
    tot_loss = tot_correct = 0.0
    for i in range(0, len(x), batch):
        l_, c_ = evaluate(params, x[i:i + batch], y[i:i + batch])
        tot_loss += float(l_)
        tot_correct += float(c_)
    return tot_loss / len(x), tot_correct / len(x)


def train(name: str, dtype, data, *, steps: int, batch: int, lr: float, seed: int,
          scale_patience: int) -> dict[str, Any]:
    """Train one run; returns its metrics and per-step curves."""
    x_tr, y_tr, x_te, y_te = data
    model = ViT(DIGITS_VIT, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_array)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps)
    opt = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = opt.init(params)
    if dtype is None:
        scaler = None
    elif jnp.dtype(dtype) == jnp.float16:
        scaler = autocast.DynamicScalerState(patience=scale_patience)
    else:
        scaler = autocast.NoOpScalerState()
    step = _make_step(static, opt, dtype)
    rng = np.random.default_rng(seed)  # same batch order for every run
    order = np.concatenate([rng.permutation(len(x_tr))
                            for _ in range(steps * batch // len(x_tr) + 2)])
    x_bs, y_bs = jnp.asarray(x_tr[:batch]), jnp.asarray(y_tr[:batch])
    loss_for_memory = (loss_fn if dtype is None
                       else autocast.amp(loss_fn, compute_dtype=dtype))
    act = C.residual_bytes(lambda p, x, y: loss_for_memory(eqx.combine(p, static), x, y)[0],
                           params, x_bs, y_bs)["activation"]

    losses, scales, times, skipped = [], [], [], 0
    bar = _progress(steps, f"{name:>8}")
    for i in range(steps):
        idx = order[i * batch:(i + 1) * batch]
        xb, yb = jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx])
        t0 = time.perf_counter()
        params, opt_state, scaler, loss, finite = C.block(step(params, opt_state, scaler, xb, yb))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        skipped += not bool(finite)
        scales.append(float(scaler.scaler) if isinstance(scaler, autocast.DynamicScalerState)
                      else None)
        bar.update(1)
        if i % 20 == 0 or i == steps - 1:
            bar.set_postfix_str(f"loss {losses[-1]:.3f}"
                                + (f" scale {scales[-1]:.0f}" if scales[-1] else ""))
    bar.close()

    evaluate = _make_eval(static, dtype)
    train_loss, train_acc = _evaluate(evaluate, params, x_tr, y_tr)
    test_loss, test_acc = _evaluate(evaluate, params, x_te, y_te)
    return {
        "run": name,
        "compute_dtype": "float32" if dtype is None else jnp.dtype(dtype).name,
        "train_loss": train_loss,
        "train_acc": train_acc,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "median_step_s": statistics.median(times[1:]) if steps > 1 else times[0],
        "first_step_s": times[0],
        "activation_bytes": act,
        "skipped_steps": skipped,
        "final_scale": scales[-1] if dtype is not None and scales[-1] is not None
        else (1.0 if dtype is not None else None),
        "losses": losses,
        "scales": scales,
    }


def table(results: list[dict[str, Any]]) -> str:
    """The demo's markdown table."""
    rows = ["| run | final train loss | test accuracy | median step time | activation memory "
            "| skipped steps | final loss scale |", "|---|---|---|---|---|---|---|"]
    for r in results:
        scale = "-" if r["final_scale"] is None else f"{r['final_scale']:g}"
        rows.append(
            f"| {r['run']} | {r['train_loss']:.4f} | {100 * r['test_acc']:.2f} % | "
            f"{r['median_step_s'] * 1e3:.2f} ms | {C.fmt_bytes(r['activation_bytes'])} | "
            f"{r['skipped_steps']} | {scale} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path) -> bool:
    """Loss curves of every run and the loss scale over steps; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        losses = np.asarray(r["losses"])
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax1.plot(np.arange(len(smooth)) + k - 1, smooth,
                 label=f"{r['run']} (test acc {100 * r['test_acc']:.1f} %)")
        if r["compute_dtype"] == "float16":
            ax2.plot(r["scales"], label=f"{r['run']} (dynamic)", color="C1")
        elif r["compute_dtype"] == "bfloat16":
            ax2.plot(np.ones(len(losses)), "--", label=f"{r['run']} (no scaling)", color="C2")
    ax1.set(xlabel="step", ylabel="train loss (moving average)", yscale="log",
            title="Digits ViT: training loss")
    ax2.set(xlabel="step", ylabel="loss scale", yscale="log", title="Loss scale")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="training steps per run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale-patience", type=int, default=200,
                    help="finite steps before the f16 loss scale grows (autocast's default "
                    "is 2000; shorter here so the plot shows the scaler at work)")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--out", default="demo", help="file stem in benchmarks/results/")
    args = ap.parse_args(argv)

    meta = C.metadata()
    cmd = "python -m benchmarks.demo " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Digits ViT demo on {meta['backend']} ({meta['device']}), jax "
          f"{meta['versions']['jax']}: {args.steps} steps x batch {args.batch} per run",
          flush=True)
    data = load_digits(args.seed)
    print(f"data: {len(data[0])} train / {len(data[2])} test images (scikit-learn digits)",
          flush=True)
    results = [train(name, RUNS[name], data, steps=args.steps, batch=args.batch, lr=args.lr,
                     seed=args.seed, scale_patience=args.scale_patience)
               for name in args.runs]
    md = table(results)
    print("\n" + md)
    ref = next((r for r in results if r["run"] == "fp32"), None)
    if ref:
        for r in results:
            if r is not ref:
                d = 100 * (r["test_acc"] - ref["test_acc"])
                print(f"{r['run']}: test accuracy {d:+.2f} points vs fp32")
    C.write_json(C.RESULTS_DIR / f"{args.out}.json",
                 {"command": cmd, "meta": meta, "args": vars(args), "results": results})
    (C.RESULTS_DIR / f"{args.out}.md").write_text(
        f"## Digits ViT demo\n\nCommand: `{cmd}`\n\n{C.metadata_markdown(meta)}\n"
        f"Activation memory: bytes of vjp residuals at batch {args.batch}. Final train loss "
        f"and accuracies: whole train/test split, evaluated in the run's precision. Median "
        f"step time excludes the first (compiling) step.\n\n{md}\n")
    png = C.RESULTS_DIR / f"{args.out}.png"
    if plot(results, png):
        print(f"wrote {png}")
    else:
        print("matplotlib not installed: no plot (pip install -e '.[demo]')")
    return results


if __name__ == "__main__":
    main()
