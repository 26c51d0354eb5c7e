"""Train a small ViT on scikit-learn's handwritten digits: float32 vs autocast f16, bf16 and fp8.

The dataset ships with scikit-learn (1,797 8x8 images, no download). For every seed
(default: seed 0) the same model is trained four times; the seed fixes the train/test
split, the initialisation and the batch order, and the runs share all three:

- ``fp32``: plain float32;
- ``amp-f16``: ``autocast.amp(loss, compute_dtype=float16)`` with the dynamic loss scaler;
- ``amp-bf16``: ``autocast.amp(loss, compute_dtype=bfloat16)`` (no loss scaling needed);
- ``amp-fp8``: as ``amp-bf16`` with the float8 policy (``autocast.load_policy("fp8")``)
  without its cost check (``use_float8(target=None)``: this ViT's matmuls are far too small
  for float8 to pay on a GPU, and the run checks float8's accuracy): the weight matmuls run
  as scaled float8 products (see docs/fp8.md);
- ``amp-bf16-sr``: as ``amp-bf16`` with the parameters and AdamW's moments stored in
  bfloat16 (``autocast.optim.to_half_params``, ``autocast.optim.half_state``), updated in float32 and
  rounded back stochastically (``optimizer_update(..., key=)``; see docs/memory.md). Not in
  the default runs: ``--runs amp-bf16 amp-bf16-sr``.

Each run type compiles its train step once and reuses it for every seed. The demo prints
the test accuracy of every run and seed, its mean, min and max over the seeds, the mean of
the per-seed differences to fp32 (in points) and of fp8 to bf16, a verdict on the targets
"f16 and bf16 mean accuracy within one point of fp32, or better" and "fp8 within one point
of bf16, or better" (a run more accurate than its reference meets its target), and the
final train loss, median step time, activation memory, skipped steps and final loss scale. It writes every seed's numbers to ``benchmarks/results/accuracy/demo.{md,json}`` and
the loss curves and loss scale of the first seed to ``demo.png``. The default (one seed,
four runs of 1,000 steps) is meant to finish within about 5 minutes on a 2-core CPU; the
accuracy check over three seeds is one flag away. The code is unchanged on a GPU. From
the repo root::

    pip install -e ".[demo]"
    python -m benchmarks.accuracy.demo                 # or: python benchmarks/accuracy/demo.py
    python -m benchmarks.accuracy.demo --seeds 0 1 2   # the three-seed accuracy check
    python -m benchmarks.accuracy.demo --runs amp-bf16 amp-fp8 --out demo_fp8
    python -m benchmarks.accuracy.demo --runs amp-bf16 amp-bf16-sr --out demo_sr
    python -m benchmarks.accuracy.demo --steps 300     # shorter runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/accuracy/demo.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.accuracy"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
from benchmarks import _common as C
from benchmarks.models.vit import ViT, ViTConfig, loss_fn

#: The demo model: 8x8 grey images, 2x2 patches (16 tokens + cls), width 64, 4 blocks.
DIGITS_VIT = ViTConfig(
    image_size=8, channels=1, patch=2, width=64, mlp_hidden=128, depth=4, heads=4, classes=10, pool="cls"
)

#: The seeds of the default run (the three-seed check: ``--seeds 0 1 2``); each fixes the
#: split, the initialisation and the batch order.
DEFAULT_SEEDS = (0,)

RUNS = {
    "fp32": None,
    "amp-f16": jnp.float16,
    "amp-bf16": jnp.bfloat16,
    "amp-fp8": jnp.bfloat16,
    "amp-bf16-sr": jnp.bfloat16,
}

#: The runs of ``python -m benchmarks.accuracy.demo`` without ``--runs``.
DEFAULT_RUNS = ("fp32", "amp-f16", "amp-bf16", "amp-fp8")

#: Runs whose parameters and optimizer state are stored in bfloat16 with stochastic rounding.
HALF_PARAMS = {"amp-bf16-sr"}

#: Runs judged against amp-bf16 (same seed), and their target: |mean difference| in points.
VS_BF16 = {"amp-fp8": 1.0, "amp-bf16-sr": 0.3}

#: The policy of each amp run not on the default one (``None``: ``autocast.default_amp_policy``).
POLICIES = {"amp-fp8": "fp8"}


def _float32_loss(model, x, y):
    """``loss_fn`` on a model stored in bfloat16: written for float32, as amp expects (the
    convolution needs operands of one dtype). amp casts the weights back to bfloat16 for the
    matmuls, and XLA drops the bfloat16 -> float32 -> bfloat16 round trip."""
    return loss_fn(autocast.optim.to_float32_params(model), x, y)


def _amp(dtype, policy, half=False):
    return autocast.amp(
        _float32_loss if half else loss_fn,
        compute_dtype=dtype,
        amp_policy=None if policy is None else _policy(policy),
    )


def _policy(name: str):
    """The named policy; ``"fp8"`` without its cost check (every weight matmul in float8)."""
    if name == "fp8":
        return autocast.extend_policy(
            {jax.lax.dot_general_p: autocast.use_float8(target=None)}, base=autocast.load_policy("fp8")
        )
    return autocast.load_policy(name)


def load_digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Digits as float32 ``(N, 1, 8, 8)`` standardised images; stratified 80/20 split."""
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    data = _load()
    x = (data.images.astype(np.float32) / 16.0)[:, None]
    y = data.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
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


def _make_step(static, opt, dtype, policy=None, half=False):
    """A jitted train step ``(params, opt_state, scaler, x, y) -> (..., loss, finite)``.

    With ``half``, ``opt`` is a ``half_state`` optimizer and ``opt_state`` the pair
    ``(its state, a PRNG key)``: the key is split every step for the parameters' rounding.
    """
    if dtype is None:

        def step(params, opt_state, scaler, x, y):
            (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(eqx.combine(params, static), x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, scaler, loss, True

        return jax.jit(step)

    grad_fn = autocast.dynamic_scale_value_and_grad(_amp(dtype, policy, half), has_aux=True)

    if half:

        def half_step(params, state, scaler, x, y):
            opt_state, key = state
            key, step_key = jax.random.split(key)
            model = eqx.combine(params, static)
            scaler, ((loss, _), grads) = grad_fn(model, x, y, dynamic_scaler_state=scaler)
            model, opt_state = autocast.optimizer_update(
                model, opt, opt_state, grads, scaler.grads_finite, key=step_key
            )
            return eqx.filter(model, eqx.is_array), (opt_state, key), scaler, loss, scaler.grads_finite

        return jax.jit(half_step)

    def step(params, opt_state, scaler, x, y):
        model = eqx.combine(params, static)
        scaler, ((loss, _), grads) = grad_fn(model, x, y, dynamic_scaler_state=scaler)
        model, opt_state = autocast.optimizer_update(model, opt, opt_state, grads, scaler.grads_finite)
        return eqx.filter(model, eqx.is_array), opt_state, scaler, loss, scaler.grads_finite

    return jax.jit(step)


def _make_eval(static, dtype, policy=None, half=False):
    """Jitted ``(params, x, y) -> (sum of losses, number correct)`` in the run's precision."""
    f = loss_fn if dtype is None else _amp(dtype, policy, half)

    @jax.jit
    def evaluate(params, x, y):
        loss, acc = f(eqx.combine(params, static), x, y)
        return loss * x.shape[0], acc * x.shape[0]

    return evaluate


def _evaluate(evaluate, params, x, y, batch: int = 512) -> tuple[float, float]:
    tot_loss = tot_correct = 0.0
    for i in range(0, len(x), batch):
        l_, c_ = evaluate(params, x[i : i + batch], y[i : i + batch])
        tot_loss += float(l_)
        tot_correct += float(c_)
    return tot_loss / len(x), tot_correct / len(x)


def _optimizer(steps: int, lr: float) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay; the same for every run and seed."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps)
    return optax.adamw(schedule, weight_decay=1e-4)


def _setup(dtype, static, params, opt, x, y, policy=None, half=False) -> dict[str, Any]:
    """One run type's jitted step and evaluation and its activation bytes, for every seed.

    Every seed builds the same model structure (only the arrays differ), so the jitted
    functions see the same shapes and compile once. With ``half`` the optimizer is
    ``autocast.optim.half_state(opt)`` (returned as ``"opt"``) and ``params`` are bfloat16.
    """
    if half:
        opt = autocast.optim.half_state(opt)
    loss_for_memory = loss_fn if dtype is None else _amp(dtype, policy, half)
    act = C.residual_bytes(
        lambda p, x, y: loss_for_memory(eqx.combine(p, static), x, y)[0], params, jnp.asarray(x), jnp.asarray(y)
    )["activation"]
    return {
        "static": static,
        "step": _make_step(static, opt, dtype, policy, half),
        "opt": opt,
        "evaluate": _make_eval(static, dtype, policy, half),
        "activation_bytes": act,
    }


def _state_bytes(tree) -> int:
    """Bytes of the array leaves of the parameters and optimizer state (PRNG keys as their data)."""
    arrays = [
        jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in jax.tree.leaves(tree)
    ]
    return int(sum(x.nbytes for x in arrays if eqx.is_array(x)))


def train(
    name: str,
    dtype,
    data,
    *,
    seed: int,
    steps: int,
    batch: int,
    opt,
    scale_patience: int,
    cache: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Train one run for one seed; returns its metrics and per-step curves.

    ``cache`` holds the compiled functions of each run type (filled on first use), so
    later seeds reuse them.
    """
    x_tr, y_tr, x_te, y_te = data
    params, static = eqx.partition(ViT(DIGITS_VIT, key=jax.random.key(seed)), eqx.is_array)
    half = name in HALF_PARAMS
    if half:  # the same initialisation, stored in bfloat16
        params = autocast.optim.to_half_params(params)
    if name not in cache:
        cache[name] = _setup(dtype, static, params, opt, x_tr[:batch], y_tr[:batch], POLICIES.get(name), half)
    shared = cache[name]
    if not eqx.tree_equal(static, shared["static"]):
        raise RuntimeError(
            "the model's non-array part differs between seeds; the shared compiled step would run the wrong model"
        )
    opt_state = shared["opt"].init(params)
    if half:  # the rounding keys: the optimizer's inside its state, the parameters' beside it
        opt_state = (eqx.tree_at(lambda s: s.key, opt_state, jax.random.key(2 * seed)), jax.random.key(2 * seed + 1))
    if dtype is None:
        scaler = None
    elif jnp.dtype(dtype) == jnp.float16:
        scaler = autocast.DynamicScalerState(patience=scale_patience)
    else:
        scaler = autocast.NoOpScalerState()
    rng = np.random.default_rng(seed)  # the same batch order for every run of this seed
    order = np.concatenate([rng.permutation(len(x_tr)) for _ in range(steps * batch // len(x_tr) + 2)])

    step = shared["step"]
    losses, scales, times, skipped = [], [], [], 0
    bar = _progress(steps, f"seed {seed} {name:>8}")
    for i in range(steps):
        idx = order[i * batch : (i + 1) * batch]
        xb, yb = jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx])
        t0 = time.perf_counter()
        params, opt_state, scaler, loss, finite = C.block(step(params, opt_state, scaler, xb, yb))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        skipped += not bool(finite)
        if isinstance(scaler, autocast.DynamicScalerState):
            scales.append(float(scaler.scaler))
        bar.update(1)
        if i % 20 == 0 or i == steps - 1:
            bar.set_postfix_str(f"loss {losses[-1]:.3f}" + (f" scale {scales[-1]:.0f}" if scales else ""))
    bar.close()

    train_loss, train_acc = _evaluate(shared["evaluate"], params, x_tr, y_tr)
    test_loss, test_acc = _evaluate(shared["evaluate"], params, x_te, y_te)
    return {
        "run": name,
        "seed": seed,
        "compute_dtype": "float32" if dtype is None else jnp.dtype(dtype).name,
        "policy": POLICIES.get(name, "default"),
        "stored": "bfloat16+sr" if half else "float32",
        "state_bytes": _state_bytes((params, opt_state)),
        "train_loss": train_loss,
        "train_acc": train_acc,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "median_step_s": statistics.median(times[1:]) if steps > 1 else times[0],
        "first_step_s": times[0],
        "activation_bytes": shared["activation_bytes"],
        "skipped_steps": skipped,
        "final_scale": None if dtype is None else (scales[-1] if scales else 1.0),
        "losses": [float(f"{v:.6g}") for v in losses],
        "scales": scales or None,
    }


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run type: every seed's numbers, their mean/std/min/max, the paired difference to fp32."""
    ref = {r["seed"]: r["test_acc"] for r in results if r["run"] == "fp32"}
    bf16 = {r["seed"]: r["test_acc"] for r in results if r["run"] == "amp-bf16"}
    out = []
    for name in dict.fromkeys(r["run"] for r in results):
        rs = [r for r in results if r["run"] == name]
        accs = [r["test_acc"] for r in rs]
        diffs = [100 * (r["test_acc"] - ref[r["seed"]]) for r in rs] if ref else None
        d_bf16 = [100 * (r["test_acc"] - bf16[r["seed"]]) for r in rs] if bf16 and name in VS_BF16 else None
        out.append(
            {
                "run": name,
                "compute_dtype": rs[0]["compute_dtype"],
                "seeds": [r["seed"] for r in rs],
                "test_acc_per_seed": accs,
                "test_acc_mean": statistics.mean(accs),
                "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "test_acc_min": min(accs),
                "test_acc_max": max(accs),
                "diff_vs_fp32_points_per_seed": diffs,
                "diff_vs_fp32_points_mean": statistics.mean(diffs) if diffs else None,
                "diff_vs_bf16_points_per_seed": d_bf16,
                "diff_vs_bf16_points_mean": statistics.mean(d_bf16) if d_bf16 else None,
                "train_loss_per_seed": [r["train_loss"] for r in rs],
                "train_loss_mean": statistics.mean(r["train_loss"] for r in rs),
                "median_step_s_per_seed": [r["median_step_s"] for r in rs],
                "median_step_s_mean": statistics.mean(r["median_step_s"] for r in rs),
                "activation_bytes": rs[0]["activation_bytes"],
                "state_bytes": rs[0]["state_bytes"],
                "skipped_steps_per_seed": [r["skipped_steps"] for r in rs],
                "final_scale_per_seed": [r["final_scale"] for r in rs],
            }
        )
    return out


def meets_target(diff_points: float, points: float) -> bool:
    """The demo's accuracy target: a run's mean accuracy is within ``points`` of its reference's,
    or better (``diff_points``: the run's minus the reference's, in points). Being more accurate
    than the reference is not a miss."""
    return diff_points >= -points - 1e-9


def _points(points: float) -> str:
    return "one point" if points == 1.0 else f"{points:g} points"


def _conclusion(ok: bool, points: float, reference: str) -> str:
    if ok:
        return f"within {_points(points)} of {reference}, or better: target met"
    return f"more than {_points(points)} below {reference}: target missed"


def verdict(summary: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Whether the f16 and bf16 runs' mean test accuracy is within one point of fp32's or better,
    the fp8 run's within one point of bf16's or better and the bf16-sr run's within 0.3 points of
    bf16's or better (means of the per-seed differences; :func:`meets_target`). The keys
    ``within_one_point`` (per run against fp32), ``fp8_within_one_point_of_bf16`` and
    ``bf16_sr_within_0.3_points_of_bf16`` say whether each target is met; ``text`` says it in words."""
    ref = next((s for s in summary if s["run"] == "fp32"), None)
    vs_bf16 = [s for s in summary if s["diff_vs_bf16_points_mean"] is not None]
    # fp32 is the reference of the f16 and bf16 runs; fp8 (bf16 with float8 matmuls) and
    # bf16-sr (bf16 with bfloat16 parameters and moments) are judged against bf16
    others = [s for s in summary if s is not ref and s["run"] not in VS_BF16]
    out: dict[str, Any] = {}
    texts = []
    n = len(summary[0]["seeds"]) if summary else 0
    if ref is not None and others:
        within = {s["run"]: meets_target(s["diff_vs_fp32_points_mean"], 1.0) for s in others}
        parts = ", ".join(
            f"{s['run']} {100 * s['test_acc_mean']:.2f} % ({s['diff_vs_fp32_points_mean']:+.2f} points)" for s in others
        )
        missed = [name for name, ok in within.items() if not ok]
        conclusion = (
            _conclusion(True, 1.0, "float32")
            if not missed
            else f"{' and '.join(missed)} {_conclusion(False, 1.0, 'float32')}"
        )
        texts.append(f"mean test accuracy fp32 {100 * ref['test_acc_mean']:.2f} %, {parts} -> {conclusion}")
        out["within_one_point"] = within
    for s in vs_bf16:
        d, target = s["diff_vs_bf16_points_mean"], VS_BF16[s["run"]]
        ok = meets_target(d, target)
        texts.append(
            f"{s['run']} vs amp-bf16: {d:+.2f} points (mean of per-seed differences) -> {_conclusion(ok, target, 'bf16')}"
        )
        key = "fp8_within_one_point_of_bf16" if s["run"] == "amp-fp8" else "bf16_sr_within_0.3_points_of_bf16"
        out[key] = ok
    if not texts:
        return None
    out["text"] = f"Verdict ({n} seed{'s' if n > 1 else ''}): " + "; ".join(texts)
    return out


def _fmt_scale(scale: float | None) -> str:
    if scale is None:
        return "-"
    k = np.log2(scale) if scale > 0 else 0.5
    return f"2^{int(k)}" if scale > 1 and k == int(k) else f"{scale:g}"


def _fmt_diff(d: float | None) -> str:
    return "-" if d is None else f"{d:+.2f}"


def table(summary: list[dict[str, Any]]) -> str:
    """The summary markdown table: one row per run type, numbers over all seeds."""
    seeds = " / ".join(str(s) for s in summary[0]["seeds"])
    rows = [
        f"| run | test accuracy, seeds {seeds} | mean | min – max | vs fp32, mean of per-seed "
        "differences (points) | final train loss (mean) | median step time (mean) | "
        "activation memory | params + optimizer state | skipped steps per seed | final loss scale per seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        accs = " / ".join(f"{100 * a:.2f}" for a in s["test_acc_per_seed"])
        rows.append(
            f"| {s['run']} | {accs} | {100 * s['test_acc_mean']:.2f} % | "
            f"{100 * s['test_acc_min']:.2f} – {100 * s['test_acc_max']:.2f} | "
            f"{_fmt_diff(s['diff_vs_fp32_points_mean']) if s['run'] != 'fp32' else '-'} | "
            f"{s['train_loss_mean']:.4f} | {s['median_step_s_mean'] * 1e3:.2f} ms | "
            f"{C.fmt_bytes(s['activation_bytes'])} | {C.fmt_bytes(s['state_bytes'])} | "
            f"{' / '.join(str(k) for k in s['skipped_steps_per_seed'])} | "
            f"{' / '.join(_fmt_scale(x) for x in s['final_scale_per_seed'])} |"
        )
    return "\n".join(rows)


def seed_table(results: list[dict[str, Any]]) -> str:
    """Every run of every seed, one row each."""
    ref = {r["seed"]: r["test_acc"] for r in results if r["run"] == "fp32"}
    rows = [
        "| seed | run | test accuracy | vs fp32 (points) | final train loss | "
        "median step time | skipped steps | final loss scale |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["seed"]):  # stable: keeps the run order
        d = 100 * (r["test_acc"] - ref[r["seed"]]) if r["seed"] in ref and r["run"] != "fp32" else None
        rows.append(
            f"| {r['seed']} | {r['run']} | {100 * r['test_acc']:.2f} % | {_fmt_diff(d)} | "
            f"{r['train_loss']:.4f} | {r['median_step_s'] * 1e3:.2f} ms | "
            f"{r['skipped_steps']} | {_fmt_scale(r['final_scale'])} |"
        )
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], summary: list[dict[str, Any]], path) -> bool:
    """Loss curves and loss scale of the first seed's runs; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    seed = results[0]["seed"]
    means = {s["run"]: s["test_acc_mean"] for s in summary}
    n = len(summary[0]["seeds"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in (r for r in results if r["seed"] == seed):
        losses = np.asarray(r["losses"])
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        label = f"{r['run']} (test acc {100 * r['test_acc']:.1f} %"
        if n > 1:
            label += f"; mean of {n} seeds {100 * means[r['run']]:.1f} %"
        ax1.plot(np.arange(len(smooth)) + k - 1, smooth, label=label + ")")
        if r["compute_dtype"] == "float16":
            ax2.plot(r["scales"], label=f"{r['run']} (dynamic)", color="C1")
        elif r["compute_dtype"] == "bfloat16":
            ax2.plot(np.ones(len(losses)), "--", label=f"{r['run']} (no scaling)", color="C2")
    ax1.set(
        xlabel="step",
        ylabel="train loss (moving average)",
        yscale="log",
        title=f"Digits ViT, seed {seed}: training loss",
    )
    ax2.set(xlabel="step", ylabel="loss scale", yscale="log", title=f"Loss scale (seed {seed})")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _write_json(path, data: Any) -> None:
    """Indented JSON with every list of plain numbers on one line (the curves are long)."""
    text = json.dumps(data, indent=2, default=str)
    text = re.sub(r"\[\n\s+([^\[\]{}\"]*?)\n\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="training steps per run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="SEED",
        help="each seed fixes the train/test split, the initialisation and the "
        "batch order, shared by the runs (default: 0; the accuracy check: --seeds 0 1 2)",
    )
    seeds.add_argument("--seed", type=int, help="a single seed: the same as --seeds SEED")
    ap.add_argument(
        "--scale-patience",
        type=int,
        default=200,
        help="finite steps before the f16 loss scale grows (autocast's default "
        "is 2000; shorter here so the plot shows the scaler at work)",
    )
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(DEFAULT_RUNS))
    ap.add_argument("--out", default="demo", help="file stem in benchmarks/results/accuracy/")
    args = ap.parse_args(argv)
    args.seeds = [args.seed] if args.seed is not None else args.seeds if args.seeds is not None else list(DEFAULT_SEEDS)
    del args.seed
    if any(not 0 <= s < 2**32 for s in args.seeds) or len(set(args.seeds)) < len(args.seeds):
        ap.error(f"--seeds: got {args.seeds}; give distinct integers in [0, 2**32)")
    if len(set(args.runs)) < len(args.runs):
        ap.error(f"--runs: got {args.runs}; give each run at most once")
    for flag, value in (("--steps", args.steps), ("--batch", args.batch)):
        if value < 1:
            ap.error(f"{flag}: got {value}; must be a positive integer")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the demo from command-line arguments; returns the per-run, per-seed results."""
    t_start = time.perf_counter()
    args = _parse(argv)
    meta = C.metadata()
    cmd = " ".join(["python -m benchmarks.accuracy.demo", *(argv if argv is not None else sys.argv[1:])])
    print(
        f"Digits ViT demo on {meta['backend']} ({meta['device']}), jax "
        f"{meta['versions']['jax']}: {args.steps} steps x batch {args.batch} per run, "
        f"seeds {' '.join(map(str, args.seeds))}",
        flush=True,
    )
    opt = _optimizer(args.steps, args.lr)
    cache: dict[str, dict[str, Any]] = {}
    results = []
    for seed in args.seeds:
        data = load_digits(seed)
        n_test = len(data[3])
        print(f"seed {seed}: {len(data[0])} train / {len(data[2])} test images (scikit-learn digits)", flush=True)
        done = [
            train(
                name,
                RUNS[name],
                data,
                seed=seed,
                steps=args.steps,
                batch=args.batch,
                opt=opt,
                scale_patience=args.scale_patience,
                cache=cache,
            )
            for name in args.runs
        ]
        print(
            f"seed {seed}: test accuracy " + ", ".join(f"{r['run']} {100 * r['test_acc']:.2f} %" for r in done),
            flush=True,
        )
        results += done

    summary = summarise(results)
    verdict_ = verdict(summary)
    md = table(summary)
    per_seed = seed_table(results)
    wall = time.perf_counter() - t_start
    print(f"\n{md}\n\n{per_seed}\n")
    if verdict_:
        print(verdict_["text"])
    print(f"wall time {wall / 60:.1f} min", flush=True)
    _write_json(
        C.results_dir("accuracy") / f"{args.out}.json",
        {
            "command": cmd,
            "meta": meta,
            "args": vars(args),
            "wall_time_s": wall,
            "verdict": verdict_,
            "summary": summary,
            "results": results,
        },
    )
    (C.results_dir("accuracy") / f"{args.out}.md").write_text(
        f"## Digits ViT demo\n\nCommand: `{cmd}`\n\n{C.metadata_markdown(meta)}"
        f"- wall time: {wall / 60:.1f} min ({len(args.seeds)} seeds x {len(args.runs)} runs "
        f"x {args.steps} steps)\n\n"
        f"Every seed fixes the train/test split, the initialisation and the batch order, "
        f"shared by the runs of that seed. Activation memory: bytes of vjp residuals at "
        f"batch {args.batch} (the same for every seed). Final train loss and accuracies: "
        f"whole train/test split, evaluated in the run's precision. Median step time "
        f"excludes each run's first step; each run type compiles once, in its first seed. "
        f"*vs fp32*: test accuracy minus fp32's of the same seed, in points (one test image "
        f"is {100 / n_test:.2f} points).\n\n{md}\n\n"
        f"Per seed:\n\n{per_seed}\n" + (f"\n{verdict_['text']}\n" if verdict_ else "")
    )
    png = C.results_dir("accuracy") / f"{args.out}.png"
    if plot(results, summary, png):
        print(f"wrote {png}")
    else:
        print("matplotlib not installed: no plot (pip install -e '.[demo]')")
    return results


if __name__ == "__main__":
    main()
