"""One-command accelerator benchmark: training steps of ViTs and a GPT-2-small-sized transformer.

For every model, the train step (forward, backward, optax AdamW update, loss scaling where
the system uses it) of every system is compiled and measured:

- systems: ``fp32``; ``autocast-bf16``, ``autocast-f16`` (dynamic loss scaler) and
  ``autocast-fp8`` (``policies/fp8.toml``: weight matmuls as scaled float8 products, the
  rest as bf16); ``autocast-bf16-sr``: amp bf16 with bfloat16 parameters and AdamW moments,
  updated with stochastic rounding (no float32 master copy); ``mpx-bf16``, the MPX recipe (the ``mpx`` package: cast the model and
  batch to half, loss head in float32), skipped with a note when ``mpx`` is not importable;
- models (``benchmarks/train_steps.py``): ViT-Base (224x224, patch 16, 768/3072, 12 blocks)
  and the MPX paper's "desktop" ViT (``benchmarks/vit.py``), and a GPT-2-small-sized causal
  transformer (12 blocks, width 768, 12 heads, 1024 tokens, vocabulary 50257, tied
  embeddings); ``--models gpt-1b``: a 1B-parameter GPT (16 blocks, width 2048, 2048 tokens);
- numbers: median step time (calls interleaved across systems), peak device memory
  (``device.memory_stats()``; each system in its own process on a GPU/TPU; ``n/a`` on
  CPU), the relative L2 error of the step-0 gradient against ``fp32``'s, and whether the
  step holds float8 GEMMs: ``__cublas$lt$matmul$f8`` custom calls in the compiled HLO (GPU),
  and dot_generals with ``f8E4M3FN`` operands in the lowered StableHLO (any backend).

The backend is the one ``jax.devices()`` gives. Results go to
``benchmarks/results/gpu-<device>-<date>.{md,json}`` with the device name, the versions and
the command. ``--smoke`` runs the same code with tiny sizes (a few seconds on a CPU; the
test suite runs it). From the repository root::

    bash benchmarks/run_gpu.sh            # = PYTHONPATH=. python -m benchmarks.gpu
    bash benchmarks/run_gpu.sh --target h100   # compiled for an H100 without one (benchmarks/deviceless.py)
    bash benchmarks/run_gpu.sh --models gpt2-small --repeats 50
    python -m benchmarks.gpu --smoke --out-dir /tmp/gpu-smoke

The files: this one measures and holds the command line; ``benchmarks/train_steps.py`` the
models and systems; ``benchmarks/deviceless.py`` the ``--target`` compiles and their
report; ``benchmarks/hlo_model.py`` the reading of the compiled HLO (census, roofline model).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/gpu.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

import equinox as eqx
import jax
import numpy as np
import optax

from benchmarks import _common as C
from benchmarks.train_steps import (
    DEFAULT_MODELS,
    MODELS,
    SMOKE_MODELS,
    SYSTEMS,
    TARGET_MODELS,
    Task,
    build_system,
    mpx_available,
)

__all__ = ["DEFAULT_MODELS", "MODELS", "SMOKE_MODELS", "SYSTEMS", "TARGET_MODELS", "build_system", "main"]

# ----------------------------------------------------------------------------- measuring

_CUBLAS_F8 = "__cublas$lt$matmul$f8"
_STABLEHLO_F8_DOT = re.compile(r"stablehlo\.dot_general[^\n]*f8E4M3FN")


def fp8_in_hlo(lowered: Any, compiled: Any) -> dict[str, int]:
    """Float8 matmuls in a step: dot_generals with ``f8E4M3FN`` operands in the lowered
    StableHLO, and cuBLASLt fp8 GEMM custom calls in the compiled HLO (GPU only)."""
    return {
        "stablehlo_f8_dots": len(_STABLEHLO_F8_DOT.findall(lowered.as_text())),
        "cublas_f8_gemms": compiled.as_text().count(_CUBLAS_F8),
    }


def _rel_err(grads: Any, ref: Any) -> float | None:
    """Relative L2 error of a gradient; None if it is not finite (a step the loss scaler skips)."""
    a = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(grads)]
    b = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(ref)]
    if not all(np.isfinite(x).all() for x in a):
        return None
    diff = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b)))
    return float(diff / np.sqrt(sum(np.sum(y**2) for y in b)))


# Smoke runs: XLA's HLO passes still run, LLVM's backend optimisation is lowered (the
# tiny steps' time is compile time; see tests/test_models_equinox.py FAST_COMPILE).
SMOKE_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_compiler_options: dict[str, Any] | None = None


def _prepare(task: Task, name: str):
    params, static = eqx.partition(task.model, eqx.is_array)
    opt = optax.adamw(1e-4, weight_decay=1e-4)
    system = build_system(name, task, static, opt)
    params, opt_state = system.init(params, opt)
    with system.context():
        jitted = jax.jit(system.step, compiler_options=_compiler_options)
        (lowered, compiled), times = C.trace_lower_compile(jitted, params, opt_state, system.scaler, task.batch)
        out = C.block(compiled(params, opt_state, system.scaler, task.batch))  # step 0: its gradient
    run = lambda: compiled(params, opt_state, system.scaler, task.batch)  # noqa: E731
    info = {
        "compile_s": times["total"],
        "fp8": fp8_in_hlo(lowered, compiled),
        "loss0": float(out[3]),
        "grads0": out[4],
        "xla_memory": C.compiled_memory(compiled),
    }
    return system, run, info


def measure_in_process(task: Task, names: list[str], *, warmup: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Every system of ``names`` on ``task`` in this process; step times interleaved."""
    results: dict[str, dict[str, Any]] = {}
    runners = {}
    for name in names:
        try:
            system, run, info = _prepare(task, name)
        except Exception as e:  # noqa: BLE001 - a failing system is a result
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            continue
        results[name] = info
        runners[name] = (system, run)
    if runners:
        with contextlib.ExitStack() as stack:
            # MPX's half dtype is a global setting: only one MPX system per run, entered for all
            for system, _ in runners.values():
                stack.enter_context(system.context())
            timing = C.interleaved_medians({n: r for n, (_, r) in runners.items()}, warmup=warmup, repeats=repeats)
        for name, t in timing.items():
            results[name]["median_step_s"] = t["median"]
            results[name]["iqr_step_s"] = t["iqr"]
    return results


def _child(model: str, name: str, smoke: bool, warmup: int, repeats: int) -> None:
    """One system in a fresh process: its peak device memory is its own."""
    task = (SMOKE_MODELS if smoke else MODELS)[model]().materialise()
    res = measure_in_process(task, [name], warmup=warmup, repeats=repeats)[name]
    res["peak_bytes"] = C.device_peak_bytes()
    grads = res.pop("grads0", None)
    if grads is not None:
        np.savez(
            os.environ["AUTOCAST_GPU_GRADS"], *[np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads)]
        )
    print(json.dumps(res, default=str))


def measure_isolated(model: str, names: list[str], *, smoke: bool, warmup: int, repeats: int, tmp: Path):
    """Every system in its own process (peak device memory per system); gradients come
    back through ``.npz`` files."""
    results = {}
    for name in names:
        grads_path = tmp / f"{model}-{name}.npz"
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--_child", model, name, "--warmup", str(warmup)]
        cmd += ["--repeats", str(repeats)] + (["--smoke"] if smoke else [])
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", AUTOCAST_GPU_GRADS=str(grads_path))
        root = Path(__file__).resolve().parent.parent
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            res = {"error": (proc.stderr.strip().splitlines() or ["child failed"])[-1][:300]}
        if grads_path.exists():
            with np.load(grads_path) as z:
                res["grads0"] = [z[k] for k in sorted(z.files, key=lambda s: int(s.split("_")[1]))]
        results[name] = res
    return results


# ----------------------------------------------------------------------------- report


def _fmt(v, spec, suffix="") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def _fp8_cell(res: dict[str, Any], backend: str) -> str:
    f = res.get("fp8")
    if not f:
        return "-"
    if backend == "gpu":
        return f"{f['cublas_f8_gemms']} cuBLASLt f8 GEMMs ({f['stablehlo_f8_dots']} f8 dots lowered)"
    return f"{f['stablehlo_f8_dots']} f8E4M3FN dots lowered (cuBLASLt: n/a on {backend})"


def table(model: str, desc: str, results: dict[str, dict[str, Any]], backend: str) -> str:
    base = results.get("fp32", {}).get("median_step_s")
    rows = [
        f"### {model}\n\n{desc}\n",
        "| system | median step time | vs fp32 | peak device memory | step-0 gradient error vs fp32 | fp8 GEMMs |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error']} | | | | |")
            continue
        t = r.get("median_step_s")
        ratio = t / base if t is not None and base else None
        peak = r.get("peak_bytes")
        err = r.get("grad_err_vs_fp32")
        err_cell = "non-finite (step skipped by the loss scaler)" if err is None and "grad_err_vs_fp32" in r else None
        rows.append(
            f"| {name} | {_fmt(t and t * 1e3, '.2f', ' ms')} | {_fmt(ratio, '.2f', 'x')} | "
            f"{'n/a' if peak is None else C.fmt_bytes(peak)} | {err_cell or _fmt(err, '.2e')} | {_fp8_cell(r, backend)} |"
        )
    return "\n".join(rows)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats: checks the code on any backend")
    ap.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=None,
        help=f"default: {' '.join(DEFAULT_MODELS)}; with --target also {' '.join(sorted(set(TARGET_MODELS) - set(DEFAULT_MODELS)))}",
    )
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per system (default 20; smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per system (default 3; smoke 1)")
    ap.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="each system in its own process, for its peak device memory (auto: on a GPU/TPU)",
    )
    ap.add_argument("--out-dir", default=None, help="where the results go (default: benchmarks/results)")
    ap.add_argument(
        "--target",
        choices=("h100",),
        default=None,
        help="compile for this GPU without one (deviceless; needs the jax-cuda plugin): kernels, GEMMs, memory",
    )
    ap.add_argument(
        "--save-hlo",
        default=None,
        metavar="DIR",
        help="--target: write each step's optimised HLO (gzipped) there, for python -m benchmarks.deviceless --reanalyse",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("triton", "cublas"),
        default=["triton", "cublas"],
        help="--target: GEMM modes (default both)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="--target with --save-hlo: take a step's figures from DIR/<step>.json where an earlier run wrote them",
    )
    ap.add_argument(
        "--batch-mults", nargs="+", type=int, default=[1, 4], help="--target: batch sizes as multiples (default 1 4)"
    )
    ap.add_argument("--_child", nargs=2, metavar=("MODEL", "SYSTEM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = args.models or list(TARGET_MODELS if args.target else DEFAULT_MODELS)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    if any(m < 1 for m in args.batch_mults):
        ap.error(f"--batch-mults: got {args.batch_mults}; each must be an integer >= 1")
    for flag, v, low in (("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if v < low:
            ap.error(f"{flag}: got {v}; must be an integer >= {low}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns what it writes to the ``.json`` file."""
    global _compiler_options
    args = _parse(argv)
    _compiler_options = SMOKE_COMPILE if args.smoke and jax.default_backend() == "cpu" else None
    if args._child:
        _child(*args._child, args.smoke, args.warmup, args.repeats)
        return {}
    cmd = " ".join(["python -m benchmarks.gpu", *(argv if argv is not None else sys.argv[1:])])
    if args.target:
        from benchmarks import deviceless

        names = [n for n in args.systems if n != "mpx-bf16" or mpx_available()]
        skipped = ["- mpx-bf16: skipped, `mpx` is not importable here."] if len(names) < len(args.systems) else []
        return deviceless.run(args, cmd, names, skipped)
    t0 = time.perf_counter()
    meta = C.metadata()
    backend = jax.default_backend()
    device = jax.devices()[0].device_kind
    isolate = args.isolate == "yes" or (args.isolate == "auto" and backend != "cpu")
    names = list(args.systems)
    notes = []
    if "mpx-bf16" in names and not mpx_available():
        names.remove("mpx-bf16")
        notes.append("- mpx-bf16: skipped, the `mpx` package (mixed-precision-for-jax) is not importable here.")
    if backend == "cpu":
        notes.append(
            "- CPU: no peak device memory (`memory_stats()` is absent: n/a); XLA-CPU runs float8 dots by converting "
            "to a wider type, so fp8 step times here say nothing about a GPU."
        )
    out_dir = Path(args.out_dir) if args.out_dir else C.RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    factories = SMOKE_MODELS if args.smoke else MODELS
    print(f"GPU benchmark on {backend} ({device}), jax {jax.__version__}; models {args.models}, systems {names}")
    report: dict[str, Any] = {"command": cmd, "meta": meta, "args": vars(args), "smoke": args.smoke, "models": {}}
    sections = []
    for model in args.models:
        task = factories[model]().materialise()
        if isolate:
            res = measure_isolated(
                model, names, smoke=args.smoke, warmup=args.warmup, repeats=args.repeats, tmp=out_dir
            )
        else:
            res = measure_in_process(task, names, warmup=args.warmup, repeats=args.repeats)
        ref = res.get("fp32", {}).get("grads0")
        for r in res.values():
            g = r.pop("grads0", None)
            if g is not None and ref is not None:
                r["grad_err_vs_fp32"] = _rel_err(g, ref)
        for p in out_dir.glob(f"{model}-*.npz"):
            p.unlink()
        report["models"][model] = {"description": task.description, "results": res}
        sections.append(table(model, task.description, res, backend))
        print(sections[-1], flush=True)
    wall = time.perf_counter() - t0
    report["wall_time_s"] = wall
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or backend
    stem = out_dir / f"gpu-{slug}-{date}{'-smoke' if args.smoke else ''}"
    C.write_json(stem.with_suffix(".json"), report)
    md = (
        f"## Training-step benchmark ({backend}: {device})\n\nCommand: `{cmd}`\n\n{C.metadata_markdown(meta)}"
        f"- wall time: {wall / 60:.1f} min; {args.warmup} warm-up and {args.repeats} timed steps per system, "
        f"interleaved; {'each system in its own process' if isolate else 'all systems in one process'}\n\n"
        "Gradient error: relative L2 error of the step-0 gradient (all parameters) against fp32's, same "
        "parameters and batch. fp8 GEMMs: cuBLASLt float8 GEMM custom calls in the compiled step (GPU), "
        "dot_generals with float8_e4m3fn operands in the lowered StableHLO.\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + "\n\n".join(sections)
        + "\n"
    )
    stem.with_suffix(".md").write_text(md)
    print(f"wrote {stem}.md and .json ({wall:.0f} s)")
    report["paths"] = [str(stem.with_suffix(".md")), str(stem.with_suffix(".json"))]
    return report


if __name__ == "__main__":
    main()
