"""Many devices: what each collective moves, and weight-gradient error vs device count.

    python -m benchmarks.distributed.bench_distributed            # writes benchmarks/results/distributed/distributed.{md,json,_error.png}

1. **Bytes on the wire.** A 4 x 512 MLP (float32 master weights), batch 256, under
   ``jit(value_and_grad(...))`` on 8 simulated CPU devices, data parallel (batch sharded,
   parameters replicated), FSDP (parameters sharded on their first axis too) and tensor
   parallel (Megatron layout: weights alternately column- and row-sharded, batch
   replicated). For each system (float32; autocast float16; autocast float16 with
   ``weight_grad_dtype="compute"``; the MPX recipe, ``mpx.cast_to_half_precision`` of
   parameters and batch with a ``force_full_precision`` loss head) the bytes of the arrays
   each kind of collective produces, per dtype, parsed from the optimised HLO.
2. **Weight-gradient error vs device count.** A 3-layer GELU MLP of width 256, 16 rows per
   device, loss x 1024, data parallel over 1, 8, 32 and 128 simulated devices (one
   subprocess per count, with its own ``XLA_FLAGS``): the relative error of the weight
   gradients against float32 on the same mesh, for autocast (float32 weight cotangents),
   autocast with ``weight_grad_dtype="compute"`` (the behaviour before issue 16: the
   gradient leaves the matmul in half precision and is all-reduced in it) and MPX.
   float16 is the faithful proxy: XLA-CPU rewrites bfloat16 dots to float32 early, so its
   bfloat16 rows do not show the half-precision all-reduce a GPU or TPU would do.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--worker" not in sys.argv:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autocast  # noqa: E402
from benchmarks._common import metadata, metadata_markdown, results_dir, write_json  # noqa: E402

COMMAND = "python -m benchmarks.distributed.bench_distributed"
DEVICE_COUNTS = (1, 8, 32, 128)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """kind -> dtype -> bytes of the arrays the collectives of that kind produce."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in hlo.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        for dtype, dims in _ARRAY.findall(m.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d]))
            out[m.group(2)][dtype] += size * _ITEMSIZE.get(dtype, 8)
    return {k: dict(v) for k, v in out.items()}


# --- models ------------------------------------------------------------------------------


def mlp(params, x):
    for w in params:
        x = jax.nn.gelu(x @ w)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def _mpx_loss(dtype):
    import mpx

    def loss(params, x):
        mpx.set_half_precision_datatype(dtype)
        params, x = mpx.cast_to_half_precision((params, x))
        for w in params[:-1]:
            x = jax.nn.gelu(x @ w)
        head = mpx.force_full_precision(lambda x, w: jnp.mean(jax.nn.gelu(x @ w).astype(jnp.float32) ** 2), jnp.float32)
        return head(x, params[-1])

    return loss


def systems(dtype):
    return {
        "float32": mlp,
        "autocast": autocast.amp(mlp, compute_dtype=dtype),
        "autocast, weight_grad_dtype=compute (before)": autocast.amp(
            mlp, compute_dtype=dtype, weight_grad_dtype="compute"
        ),
        "mpx": _mpx_loss(dtype),
    }


def init(width, layers, rows, seed=0):
    key = jax.random.PRNGKey(seed)
    params = [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / np.sqrt(width) for i in range(layers)]
    return params, jax.random.normal(jax.random.fold_in(key, 99), (rows, width))


# --- part 1: bytes per collective ----------------------------------------------------------


def wire_bytes():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params, x = init(512, 4, 256)
    layouts = {
        "data parallel": ([P()] * 4, P("d")),
        "FSDP": ([P("d", None)] * 4, P("d")),
        "tensor parallel": ([P(None, "d"), P("d", None)] * 2, P()),
    }
    rows = []
    for layout, (pspecs, xspec) in layouts.items():
        ps = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(params, pspecs)]
        xs = jax.device_put(x, NamedSharding(mesh, xspec))
        for name, fn in systems(jnp.float16).items():
            hlo = jax.jit(jax.value_and_grad(fn)).lower(ps, xs).compile().as_text()
            rows.append({"layout": layout, "system": name, "bytes": collective_bytes(hlo)})
            print(layout, name, rows[-1]["bytes"], flush=True)
    return rows


# --- part 2: error vs device count (one subprocess per count) --------------------------------


def error_worker(n_dev):
    assert len(jax.devices()) == n_dev, (len(jax.devices()), n_dev)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params, x = init(256, 3, 16 * n_dev)
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    scaled = lambda f: lambda p, x: 1024.0 * f(p, x)  # noqa: E731
    g32 = jax.jit(jax.grad(scaled(mlp)))(ps, xs)
    out = {}
    for dtype in (jnp.float16, jnp.bfloat16):
        for name, fn in systems(dtype).items():
            if name == "float32":
                continue
            g = jax.jit(jax.grad(scaled(fn)))(ps, xs)
            err = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(g, g32))
            out[f"{np.dtype(dtype).name}/{name}"] = err
    print(json.dumps(out))


def errors():
    res = {}
    for n in DEVICE_COUNTS:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.distributed.bench_distributed", "--worker", str(n)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
        res[n] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(n, res[n], flush=True)
    return res


# --- report --------------------------------------------------------------------------------


def _fmt_bytes(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def markdown(meta, wire, errs):
    lines = [
        "# Many devices: bytes on the wire and weight-gradient error",
        "",
        f"Generated by `{COMMAND}` (`benchmarks/distributed/bench_distributed.py`).",
        "",
        metadata_markdown(meta),
        "## Bytes each collective produces, per dtype (8 simulated CPU devices)",
        "",
        "A 4 x 512 MLP (float32 master weights), batch 256, `jit(value_and_grad(...))`; float16",
        "compute. Bytes of the arrays each kind of collective produces in the optimised HLO",
        "(per device; what crosses the wire depends on the algorithm). XLA-CPU's partitioner",
        "lowers FSDP's gradient reduce-scatter as an all-reduce; a GPU/TPU one emits",
        "reduce-scatter.",
        "",
        "| layout | system | collective | f32 | f16 |",
        "|---|---|---|---:|---:|",
    ]
    for row in wire:
        for kind, by in sorted(row["bytes"].items()):
            lines.append(
                f"| {row['layout']} | {row['system']} | {kind} | {_fmt_bytes(by.get('f32', 0))} | {_fmt_bytes(by.get('f16', 0))} |"
            )
    names = list(next(iter(errs.values())).keys())
    lines += [
        "",
        "## Weight-gradient relative error against float32, by device count",
        "",
        "3-layer GELU MLP, width 256, 16 rows per device, loss x 1024, data parallel (parameters",
        "replicated). max over layers of ||g - g32|| / ||g32||. `weight_grad_dtype=compute`",
        "is the behaviour before issue 16 (weight gradient leaves the matmul, and is all-reduced,",
        "in half precision). **float16 is the faithful proxy:** XLA-CPU rewrites bfloat16 dots to",
        "float32 early, so the bfloat16 rows do not show a bfloat16 all-reduce.",
        "",
        "| devices | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n, row in errs.items():
        lines.append(f"| {n} | " + " | ".join(f"{row[k]:.2e}" for k in names) + " |")
    lines.append("")
    return "\n".join(lines)


def plot(errs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    ns = list(errs)
    for ax, dtype in zip(axes, ("float16", "bfloat16")):
        for name in next(iter(errs.values())):
            if name.startswith(dtype + "/"):
                ax.plot(ns, [errs[n][name] for n in ns], marker="o", label=name.split("/", 1)[1])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("simulated devices (data parallel)")
        ax.set_title(dtype + (" (XLA-CPU: dots rewritten to f32)" if dtype == "bfloat16" else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("weight-gradient rel. error vs float32")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        error_worker(args.worker)
        return
    meta = metadata()
    meta["command"] = COMMAND
    wire = wire_bytes()
    errs = errors()
    out = results_dir("distributed")
    write_json(out / "distributed.json", {"metadata": meta, "wire_bytes": wire, "weight_grad_error": errs})
    (out / "distributed.md").write_text(markdown(meta, wire, errs))
    plot(errs, out / "distributed_error.png")


if __name__ == "__main__":
    main()
