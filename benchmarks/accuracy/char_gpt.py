"""A small character-level GPT trained on Python's own standard library, three ways.

The text: the ``.py`` files of the running Python's standard library (``sysconfig``'s
``stdlib`` directory), sorted by path, concatenated, ASCII only: on every machine, no
download. Characters are bytes (vocabulary 128). The model: pre-LN GPT (token and position
embeddings, causal ``eqx.nn.MultiheadAttention``, GELU MLP, a final LayerNorm, an untied
head), written for float32 with no dtype anywhere. Every run shares the initialisation, the
batch order and AdamW with warm-up and cosine decay, and runs under
``autocast.amp(compute_dtype=bfloat16)``:

- ``f32-master``: float32 parameters and AdamW moments (12 bytes per parameter);
- ``bf16-sr``: bfloat16 parameters (``autocast.optim.to_half_params``) and moments
  (``autocast.optim.half_state``), updated in float32 and rounded back stochastically
  (``optimizer_update(..., key=)``): 6 bytes per parameter;
- ``bf16-rne``: the control: bfloat16 parameters and moments with round-to-nearest (plain
  ``optax.adamw`` on the bfloat16 parameters), where updates below half a bfloat16 spacing
  are lost.

It writes the train-loss curves, the validation loss every ``--eval-every`` steps and the
final validation loss (held-out text, 16 batches) to ``benchmarks/results/accuracy/char_gpt.{json,md,png}``.
From the repo root::

    python -m benchmarks.accuracy.char_gpt                   # the default: ~10 minutes on 2 CPU cores
    python -m benchmarks.accuracy.char_gpt --steps 200 --out /tmp/gpt_smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/accuracy/char_gpt.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.accuracy"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast
from benchmarks import _common as C
from benchmarks.models.char_gpt import GPT, VOCAB, GPTConfig, loss_fn


def corpus(max_bytes: int = 4_000_000) -> np.ndarray:
    """The standard library's ``.py`` sources (sorted, ASCII only) as uint8 byte ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        data = np.frombuffer(path.read_bytes(), np.uint8)
        data = data[data < VOCAB]
        chunks.append(data)
        total += data.size
        if total >= max_bytes:
            break
    return np.concatenate(chunks)[:max_bytes]


RUNS = ("f32-master", "bf16-sr", "bf16-rne")


def _optimizer(steps: int, lr: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, end_value=lr / 20)
    return optax.adamw(schedule, b2=0.99, weight_decay=0.01)


def _setup(run: str, model: GPT, steps: int, lr: float):
    """(params, optimizer state, jitted step) of one run."""
    adamw = _optimizer(steps, lr)
    params, static = eqx.partition(model, eqx.is_array)
    if run == "f32-master":
        optim = adamw
    elif run == "bf16-sr":
        params, optim = autocast.optim.to_half_params(params), autocast.optim.half_state(adamw, key=jax.random.key(1))
    elif run == "bf16-rne":
        params, optim = autocast.optim.to_half_params(params), adamw  # moments in bfloat16 too
    else:
        raise ValueError(f"run={run!r}; allowed: {RUNS}")
    grad_fn = jax.value_and_grad(
        autocast.amp(lambda p, b: loss_fn(eqx.combine(p, static), b), compute_dtype=jnp.bfloat16)
    )

    @jax.jit
    def step(params, opt_state, batch, key):
        loss, grads = grad_fn(params, batch)
        params, opt_state = autocast.optimizer_update(
            params, optim, opt_state, grads, jnp.array(True), key=key if run == "bf16-sr" else None
        )
        return params, opt_state, loss

    evaluate = jax.jit(autocast.amp(lambda p, b: loss_fn(eqx.combine(p, static), b), compute_dtype=jnp.bfloat16))
    return params, optim.init(params), step, evaluate


def _state_bytes(tree: Any) -> int:
    leaves = [
        jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in jax.tree.leaves(tree)
    ]
    return int(sum(x.nbytes for x in leaves if eqx.is_array(x)))


def train(run: str, cfg: GPTConfig, data: np.ndarray, val: np.ndarray, args) -> dict[str, Any]:
    model = GPT(cfg, key=jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    params, opt_state, step, evaluate = _setup(run, model, args.steps, args.lr)
    rng = np.random.default_rng(args.seed)  # the same batches for every run
    val_rng = np.random.default_rng(12345)
    val_batches = [
        np.stack([val[i : i + cfg.seq + 1] for i in val_rng.integers(0, len(val) - cfg.seq - 1, args.batch)])
        for _ in range(16)
    ]

    def val_loss(params):
        return float(np.mean([float(evaluate(params, jnp.asarray(b, jnp.int32))) for b in val_batches]))

    losses, evals, t0 = [], [], time.perf_counter()
    key = jax.random.key(args.seed + 1000)
    for i in range(args.steps):
        starts = rng.integers(0, len(data) - cfg.seq - 1, args.batch)
        batch = jnp.asarray(np.stack([data[s : s + cfg.seq + 1] for s in starts]), jnp.int32)
        params, opt_state, loss = step(params, opt_state, batch, jax.random.fold_in(key, i))
        losses.append(float(loss))
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            evals.append((i + 1, val_loss(params)))
            print(f"{run:>10} step {i + 1:5d}: train {np.mean(losses[-50:]):.4f}, val {evals[-1][1]:.4f}", flush=True)
    return {
        "run": run,
        "params": int(n_params),
        "state_bytes": _state_bytes((params, opt_state)),
        "bytes_per_param": _state_bytes((params, opt_state)) / n_params,
        "final_val_loss": evals[-1][1],
        "final_train_loss_last100": float(np.mean(losses[-100:])),
        "wall_s": time.perf_counter() - t0,
        "evals": evals,
        "losses": [float(f"{v:.5g}") for v in losses],
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        losses = np.asarray(r["losses"])
        k = max(1, len(losses) // 60)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax1.plot(np.arange(len(smooth)) + k, smooth, label=f"{r['run']} ({r['bytes_per_param']:.1f} B/param)")
        steps, vals = zip(*r["evals"])
        ax2.plot(steps, vals, marker=".", label=f"{r['run']}: final {r['final_val_loss']:.4f}")
    ax1.set(xlabel="step", ylabel="train loss (moving average, nats/char)", title=title)
    ax2.set(xlabel="step", ylabel="validation loss (nats/char)", title="held-out text")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylim(top=min(3.5, ax1.get_ylim()[1]))
    ax2.set_ylim(top=min(3.5, ax2.get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    ap.add_argument("--out", default="char_gpt", help="file stem in benchmarks/results/accuracy/")
    args = ap.parse_args(argv)
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, seq=args.seq)
    text = corpus()
    split = int(0.95 * len(text))
    data, val = text[:split], text[split:]
    meta = C.metadata()
    cmd = " ".join(["python -m benchmarks.accuracy.char_gpt", *(argv if argv is not None else sys.argv[1:])])
    print(f"{len(text):,} characters of Python stdlib source ({sysconfig.get_paths()['stdlib']}); {cfg}", flush=True)
    t0 = time.perf_counter()
    results = [train(run, cfg, data, val, args) for run in args.runs]
    wall = time.perf_counter() - t0
    ref = next((r for r in results if r["run"] == "f32-master"), None)
    rows = [
        "| run | bytes per parameter (params + AdamW state) | final validation loss | vs f32-master | "
        "train loss, last 100 steps | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rel = f"{100 * (r['final_val_loss'] / ref['final_val_loss'] - 1):+.2f} %" if ref else "-"
        r["vs_f32_master_percent"] = None if ref is None else 100 * (r["final_val_loss"] / ref["final_val_loss"] - 1)
        rows.append(
            f"| {r['run']} | {r['bytes_per_param']:.2f} | {r['final_val_loss']:.4f} | {rel} | "
            f"{r['final_train_loss_last100']:.4f} | {r['wall_s'] / 60:.1f} min |"
        )
    table = "\n".join(rows)
    sr = next((r for r in results if r["run"] == "bf16-sr"), None)
    verdict = None
    if ref and sr:
        ok = abs(sr["vs_f32_master_percent"]) <= 1.0
        verdict = (
            f"bf16-sr final validation loss {sr['final_val_loss']:.4f} vs f32-master {ref['final_val_loss']:.4f}: "
            f"{sr['vs_f32_master_percent']:+.2f} % -> "
            + ("within 1 %: target met" if ok else "not within 1 %: target missed")
        )
    print(f"\n{table}\n\n{verdict or ''}\nwall time {wall / 60:.1f} min", flush=True)
    out = C.results_dir("accuracy") / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": cmd,
        "meta": meta,
        "args": vars(args),
        "config": dataclasses.asdict(cfg),
        "characters": int(len(text)),
        "wall_time_s": wall,
        "verdict": verdict,
        "results": results,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    title = f"char GPT d{cfg.d_model} L{cfg.layers} seq {cfg.seq}, batch {args.batch}"
    out.with_suffix(".md").write_text(
        f"## Character-level GPT: float32 master vs bfloat16 + stochastic rounding vs round-to-nearest\n\n"
        f"Command: `{cmd}`\n\n{C.metadata_markdown(meta)}- wall time: {wall / 60:.1f} min\n"
        f"- text: {len(text):,} characters of the Python standard library's sources (95 % train, 5 % validation)\n"
        f"- model: {cfg}, {results[0]['params']:,} parameters; AdamW (b2 0.99, weight decay 0.01), lr {args.lr} "
        f"with warm-up and cosine decay, {args.steps} steps of batch {args.batch}; amp bfloat16 compute in every run\n\n"
        f"{table}\n\n" + (f"{verdict}\n\n" if verdict else "") + f"![loss curves]({out.name}.png)\n"
    )
    if plot(results, out.with_suffix(".png"), title):
        print(f"wrote {out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
