"""Step time and activation memory of an Equinox LSTM under ``lax.scan``: float32 vs
autocast bfloat16 with ``remat_float32`` = ``"auto"`` / ``True`` / ``False``.

The LSTM cell's float32 island (the cell update ``f * c + i * g`` and ``o * tanh(c)``,
float32 because the carry ``c`` is float32) has a float32 input as large as its outputs:
recomputing it in the backward pass saves little memory and, in an elementwise-bound
recurrent step, costs a second evaluation of the cell. Not recomputed, the island reads
the two matmuls' results in float32 only, so they store float32 results (``_wide.py``).
The last row is a reference: the same step with the two matmuls cast to bfloat16 by hand
(results stored in bfloat16, then converted) and nothing else changed, i.e. the usual
hand-written recipe. "vs fp32" is the ratio of median step times; "paired" is the median
over rounds of the ratio within one round (less sensitive to a shared machine's drift).
Run::

    python -m benchmarks.memory.bench_lstm_scan

Writes ``benchmarks/results/memory/lstm_scan.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast
from benchmarks import _common


class LSTM(eqx.Module):
    cell: eqx.nn.LSTMCell
    out: eqx.nn.Linear

    def __init__(self, key, features, hidden):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.LSTMCell(features, hidden, key=k1)
        self.out = eqx.nn.Linear(hidden, 1, key=k2)

    def __call__(self, xs):  # (seq, features) -> scalar
        def body(carry, x):
            carry = self.cell(x, carry)
            return carry, None

        init = (jnp.zeros(self.cell.hidden_size), jnp.zeros(self.cell.hidden_size))
        (h, _), _ = jax.lax.scan(body, init, xs)
        return self.out(h)[0]


def loss_fn(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)


def _cell_bf16_matmuls(cell: eqx.nn.LSTMCell, x, state):
    """``eqx.nn.LSTMCell`` with only its two matmuls in bfloat16 (operands cast by hand,
    results back to float32), everything else in float32: the least a bfloat16 step can
    cost on this backend, whoever inserts the casts."""
    h, c = state
    bf16 = jnp.bfloat16
    lin = (
        (cell.weight_ih.astype(bf16) @ x.astype(bf16)).astype(jnp.float32)
        + (cell.weight_hh.astype(bf16) @ h.astype(bf16)).astype(jnp.float32)
        + cell.bias
    )
    i, f, g, o = jnp.split(lin, 4)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def hand_cast_loss_fn(model, xs, ys):
    def one(xs):
        def body(carry, x):
            return _cell_bf16_matmuls(model.cell, x, carry), None

        init = (jnp.zeros(model.cell.hidden_size), jnp.zeros(model.cell.hidden_size))
        (h, _), _ = jax.lax.scan(body, init, xs)
        return model.out(h)[0]

    return jnp.mean((jax.vmap(one)(xs) - ys) ** 2)


def _step(loss, opt):
    @jax.jit
    def step(model, opt_state, xs, ys):
        value, grads = jax.value_and_grad(loss)(model, xs, ys)
        updates, opt_state = opt.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def _matmul_alone(batch: int, hidden: int, seq: int, repeats: int) -> dict[str, float]:
    """The LSTM's recurrent matmul as ``eqx.nn.LSTMCell`` under ``vmap`` makes it
    (``weight_hh @ h`` per example: ``(4 * hidden, hidden) . (batch, hidden)^T``), in a
    ``seq``-step ``scan`` whose carry feeds it: float32; bfloat16 operands with a bfloat16
    result (converted to float32); bfloat16 operands with a float32 result. What the matmul
    costs on this backend by itself, per dtype; the median over rounds of each one's time
    over float32's in the same round."""
    a = jax.random.normal(jax.random.key(3), (batch, hidden))
    w = jax.random.normal(jax.random.key(4), (4 * hidden, hidden)) / hidden**0.5

    def loop(dtype, result):
        def body(c, _):
            out = jax.vmap(lambda h: jnp.matmul(w.astype(dtype), h.astype(dtype), preferred_element_type=result))(c)
            return jnp.tanh(c + out.astype(jnp.float32)[:, :hidden]), None

        return jax.jit(lambda a: jax.lax.scan(body, a, None, length=seq)[0])

    fns = {
        "float32": loop(jnp.float32, jnp.float32),
        "bfloat16": loop(jnp.bfloat16, jnp.bfloat16),
        "bfloat16, float32 result": loop(jnp.bfloat16, jnp.float32),
    }
    times = _common.interleaved_medians({k: (lambda f=f: f(a)) for k, f in fns.items()}, warmup=2, repeats=2 * repeats)
    return {k: _common.paired_ratio(times, k, "float32") for k in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="lstm_scan")
    args = parser.parse_args()
    model = LSTM(jax.random.key(0), args.features, args.hidden)
    xs = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.features))
    ys = jax.random.normal(jax.random.key(2), (args.batch,))
    opt = optax.sgd(1e-3)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    bf16 = jnp.bfloat16
    losses = {
        "fp32": loss_fn,
        "autocast-bf16 (remat auto)": autocast.amp(loss_fn, compute_dtype=bf16, remat_float32="auto"),
        "autocast-bf16 (remat True)": autocast.amp(loss_fn, compute_dtype=bf16, remat_float32=True),
        "autocast-bf16 (remat False)": autocast.amp(loss_fn, compute_dtype=bf16, remat_float32=False),
        "reference: bf16 matmuls cast by hand": hand_cast_loss_fn,
    }
    runners, residuals, losses_out = {}, {}, {}
    for name, loss in losses.items():
        step = _step(loss, opt)
        losses_out[name] = float(step(model, opt_state, xs, ys)[2])
        runners[name] = lambda step=step: step(model, opt_state, xs, ys)
        residuals[name] = _common.residual_bytes(loss, model, xs, ys)
    times = _common.interleaved_medians(runners, warmup=2, repeats=args.repeats)
    matmul = _matmul_alone(args.batch, args.hidden, args.seq, args.repeats)
    base = times["fp32"]["median"]
    meta = _common.metadata()
    command = "python -m benchmarks.memory.bench_lstm_scan " + " ".join(sys.argv[1:])
    rows = {
        name: {
            "step_median_s": times[name]["median"],
            "step_iqr_s": times[name]["iqr"],
            "step_vs_fp32": times[name]["median"] / base,
            "step_vs_fp32_paired": _common.paired_ratio(times, name, "fp32"),
            "activation_bytes": residuals[name]["activation"],
            "activation_by_dtype": residuals[name]["activation_by_dtype"],
            "loss": losses_out[name],
        }
        for name in losses
    }
    _common.write_json(
        _common.results_dir("memory") / f"{args.out}.json",
        {"command": command, "args": vars(args), "metadata": meta, "results": rows, "matmul_alone_vs_float32": matmul},
    )
    lines = [
        "# LSTM under lax.scan: step time, float32 vs autocast bfloat16\n",
        f"Command: `{command}`\n",
        _common.metadata_markdown(meta),
        "Shared machine (2 cores, several agents): step times are medians of interleaved rounds.\n",
        f"Batch {args.batch}, sequence {args.seq}, features {args.features}, hidden {args.hidden}; "
        "one SGD step under `jax.jit` (`value_and_grad`).\n",
        "| system | step (median) | vs fp32 | vs fp32, paired | activation residuals | by dtype | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        by = ", ".join(f"{k}: {_common.fmt_bytes(v)}" for k, v in sorted(r["activation_by_dtype"].items()))
        lines.append(
            f"| {name} | {r['step_median_s'] * 1e3:.2f} ms | {r['step_vs_fp32']:.2f}x | {r['step_vs_fp32_paired']:.2f}x | "
            f"{_common.fmt_bytes(r['activation_bytes'])} | {by} | {r['loss']:.5f} |"
        )
    lines += [
        "",
        f"The recurrent matmul alone (`weight_hh @ h` under `vmap`, {4 * args.hidden}x{args.hidden} . "
        f"{args.batch}x{args.hidden}, {args.seq} steps under `scan`, same run), time / float32 time "
        f"(paired): bfloat16 {matmul['bfloat16']:.2f}x, bfloat16 operands with a float32 result "
        f"{matmul['bfloat16, float32 result']:.2f}x: what bfloat16 matmuls cost by themselves on "
        "this backend and machine.",
    ]
    text = "\n".join(lines) + "\n"
    (_common.results_dir("memory") / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
