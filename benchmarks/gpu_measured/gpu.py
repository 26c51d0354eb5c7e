"""One-command accelerator benchmark: training steps of ViTs and a GPT-2-small-sized transformer.

For every model, the train step (forward, backward, optax AdamW update, loss scaling where
the system uses it) of every system is compiled and measured:

- systems: ``fp32``; ``autocast-bf16`` (attention fused where cuDNN takes it) and
  ``autocast-bf16-xla-attention`` (``attention="xla"``: as written), ``autocast-f16`` (dynamic loss scaler) and
  ``autocast-fp8`` (``policies/fp8.toml``: weight matmuls as scaled float8 products, the
  rest as bf16); ``autocast-bf16-sr``: amp bf16 with bfloat16 parameters and AdamW moments,
  updated with stochastic rounding (no float32 master copy); ``mpx-bf16``, the MPX recipe (the ``mpx`` package: cast the model and
  batch to half, loss head in float32), skipped with a note when ``mpx`` is not importable;
- models (``benchmarks/models/train_steps.py``): ViT-Base (224x224, patch 16, 768/3072, 12 blocks)
  and the MPX paper's "desktop" ViT (``benchmarks/models/vit.py``), and a GPT-2-small-sized causal
  transformer (12 blocks, width 768, 12 heads, 1024 tokens, vocabulary 50257, tied
  embeddings); ``--models gpt-1b``: a 1B-parameter GPT (16 blocks, width 2048, 2048 tokens);
  ``--models bert-base``: BERT-base (post-LN, 512 tokens with a key-padding mask, MLM loss);
  ``--vocab N``: the GPT models with a vocabulary of N (Llama 3's 128,256, Gemma's 256,000; the
  default, 50,257, is GPT-2's), recorded in the report and its file name (``-vocab<N>``);
- numbers: median step time (each step waited for, calls interleaved across systems), the
  time per step of steps dispatched back to back (only the last waited for: the host's
  work per call overlaps the device's, as in a training loop that does not read every
  loss), peak device memory
  (``device.memory_stats()``; each system in its own process on a GPU/TPU; ``n/a`` on
  CPU), the relative L2 error of the step-0 gradient against ``fp32``'s, and whether the
  step holds float8 GEMMs: ``__cublas$lt$matmul$f8`` custom calls in the compiled HLO (GPU),
  and dot_generals with ``f8E4M3FN`` operands in the lowered StableHLO (any backend), and
  the cuDNN fused attention calls in the compiled step (``__cudnn$fmha*``, forward and
  backward: amp's fused attention, docs/attention.md);
- ``--rounds N`` (the lent GPU's attention section, issue 47): the systems compiled first,
  all resident in one process, then timed in N rotated rounds, with the ratios taken within
  each round and each program's hash (:mod:`benchmarks.gpu_measured.rounds`): on a shared
  GPU, systems timed one after another cannot be ranked.

The backend is the one ``jax.devices()`` gives. Results go to
``benchmarks/results/gpu_measured/gpu-<device>-<date>.{md,json}`` with the device name, the versions and
the command. ``--smoke`` runs the same code with tiny sizes (a few seconds on a CPU; the
test suite runs it). From the repository root::

    bash benchmarks/gpu_measured/run_gpu.sh            # = PYTHONPATH=. python -m benchmarks.gpu_measured.gpu
    bash benchmarks/gpu_measured/run_gpu.sh --target h100   # compiled for an H100 without one (benchmarks/gpu_modeled/deviceless.py)
    bash benchmarks/gpu_measured/run_gpu.sh --models gpt2-small --repeats 50
    python -m benchmarks.gpu_measured.gpu --smoke --out-dir /tmp/gpu-smoke

The files: this one measures and holds the command line; ``benchmarks/models/train_steps.py`` the
tasks and systems (the models: ``benchmarks/models/vit.py``, ``benchmarks/models/gpt2.py``);
``benchmarks/gpu_modeled/deviceless.py`` the ``--target`` compiles and their
report; ``benchmarks/gpu_modeled/hlo_model.py`` the reading of the compiled HLO (census, roofline model).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/gpu_measured/gpu.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.gpu_measured"

import equinox as eqx
import jax
import numpy as np
import optax

from benchmarks import _common as C
from benchmarks.gpu_measured import rounds as R
from benchmarks.gpu_modeled import hlo_model
from benchmarks.gpu_modeled.deviceless import MODES, X1_ONLY
from benchmarks.models.train_steps import (
    DEFAULT_MODELS,
    EXTRA_SYSTEMS,
    GPT_MODELS,
    MODELS,
    SMOKE_MODELS,
    SYSTEMS,
    TARGET_MODELS,
    Task,
    build_system,
    make_task,
    mpx_available,
    vocab_tag,
)

__all__ = ["DEFAULT_MODELS", "MODELS", "SMOKE_MODELS", "SYSTEMS", "TARGET_MODELS", "build_system", "main"]

# ----------------------------------------------------------------------------- measuring

_CUBLAS_F8 = "__cublas$lt$matmul$f8"
_STABLEHLO_F8_DOT = re.compile(r"stablehlo\.dot_general[^\n]*f8E4M3FN")
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')


def fused_attention_in_hlo(compiled: Any) -> dict[str, int]:
    """cuDNN fused attention calls in a compiled step (``__cudnn$fmha*`` custom calls):
    ``forward`` and ``backward`` (``...Backward``). None on a CPU, none without cuDNN."""
    calls = _FMHA.findall(compiled.as_text())
    back = sum(1 for c in calls if "Backward" in c)
    return {"forward": len(calls) - back, "backward": back}


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


def _tiled(batch: Any, mult: int) -> Any:
    """The batch ``mult`` times along its leading axis (the ``--batch-mults`` steps)."""
    return batch if mult == 1 else jax.tree_util.tree_map(lambda x: np.concatenate([np.asarray(x)] * mult), batch)


@dataclasses.dataclass
class _Lowered:
    """A system's step traced and lowered, not yet compiled (:func:`_lower`)."""

    system: Any
    state: list[Any]
    lowered: Any
    lower_s: float


def _lower(task: Task, name: str, mode: str = "triton", *, copy: bool = False) -> _Lowered:
    """``name``'s step for ``task`` traced and lowered as the ``--target`` report compiles it
    (inputs donated, GEMM ``mode``), but also returning the gradient (for its error against
    fp32's). ``copy``: the step donates a copy of the task's parameters (other systems use
    them too), else the task's own."""
    params, static = eqx.partition(task.model, eqx.is_array)
    params = jax.tree_util.tree_map(lambda x: x.copy(), params) if copy else params
    opt = optax.adamw(1e-4, weight_decay=1e-4)
    system = build_system(name, task, static, opt)
    state = [*system.init(params, opt), system.scaler]
    options = {**(_compiler_options or {}), **(MODES[mode] or {})} or None
    t0 = time.perf_counter()
    with system.context():  # MPX reads its half dtype while tracing
        jitted = jax.jit(system.step, donate_argnums=(0, 1, 2), compiler_options=options)
        lowered = jitted.trace(*state, task.batch).lower()
    return _Lowered(system, state, lowered, time.perf_counter() - t0)


def _finish(task: Task, step: _Lowered, compiled: Any, compile_s: float, hlo_path: Path | None = None):
    """The compiled step run once (the step-0 gradient). Returns a runner (one training step,
    the state threaded through) and the figures of the compile, the modeled step of this very
    program on a GPU (:func:`benchmarks.gpu_modeled.hlo_model.roofline`) and its
    :func:`~benchmarks.gpu_measured.rounds.program_hash` among them; the HLO to ``hlo_path``."""
    state = step.state
    with step.system.context():
        out = C.block(compiled(*state, task.batch))  # step 0: its gradient
    state[:] = out[:3]

    def run():
        out = compiled(*state, task.batch)
        state[:] = out[:3]
        return out[:4]

    hlo = compiled.as_text()
    info = {
        "compile_s": step.lower_s + compile_s,
        "fp8": fp8_in_hlo(step.lowered, compiled),
        "fused_attention": fused_attention_in_hlo(compiled),
        "loss0": float(out[3]),
        "grads0": jax.device_get(out[4]),
        "xla_memory": C.compiled_memory(compiled),
        "program_hash": R.program_hash(hlo),
    }
    if jax.default_backend() == "gpu":
        info["roofline"] = hlo_model.roofline(hlo, hlo_model.chip_for(jax.devices()[0].device_kind))
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_bytes(gzip.compress(hlo.encode()))
    return run, info


def _prepare(task: Task, name: str, mode: str = "triton", hlo_path: Path | None = None, *, copy: bool = False):
    """``name``'s step for ``task`` lowered (:func:`_lower`), compiled and run once
    (:func:`_finish`). Returns the system, the runner and the figures."""
    step = _lower(task, name, mode, copy=copy)
    t0 = time.perf_counter()
    compiled = step.lowered.compile()
    run, info = _finish(task, step, compiled, time.perf_counter() - t0, hlo_path)
    return step.system, run, info


def measure_in_process(
    task: Task,
    names: list[str],
    *,
    warmup: int,
    repeats: int,
    mode: str = "triton",
    hlo_prefix: Path | None = None,
    kernel_times: bool = False,
    copy: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Every system of ``names`` on ``task`` in this process; step times interleaved. Each
    step's optimised HLO goes to ``<hlo_prefix>-<system>.hlo.gz`` if a prefix is given, and
    with ``kernel_times`` its GPU time per kernel, profiled after the timing, to
    ``<hlo_prefix>-<system>.kernels.json`` (:mod:`benchmarks.gpu_measured.kernel_times`).
    ``copy``: each step donates a copy of the task's parameters (default: where several
    systems share them), else the task's own."""
    results: dict[str, dict[str, Any]] = {}
    runners = {}
    for name in names:
        try:
            hlo_path = hlo_prefix.with_name(f"{hlo_prefix.name}-{name}.hlo.gz") if hlo_prefix else None
            system, run, info = _prepare(task, name, mode, hlo_path, copy=len(names) > 1 if copy is None else copy)
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
            piped = C.pipelined_medians({n: r for n, (_, r) in runners.items()}, steps=max(2, repeats // 2))
        for name, t in timing.items():
            results[name]["median_step_s"] = t["median"]
            results[name]["iqr_step_s"] = t["iqr"]
            results[name]["pipelined_step_s"] = piped[name]["median"]
        if kernel_times and hlo_prefix is not None:
            from benchmarks.gpu_measured import kernel_times as KT

            for name, (_, run) in runners.items():
                base = hlo_prefix.with_name(f"{hlo_prefix.name}-{name}")
                try:
                    per_kernel = KT.profile(run, C.block, events_path=base.with_name(base.name + ".events.json.gz"))
                except Exception as e:  # noqa: BLE001 - the timing stands without its profile
                    results[name]["kernel_times_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    continue
                base.with_name(base.name + ".kernels.json").write_text(json.dumps(per_kernel))
                results[name]["profiled_gpu_ms"] = sum(v["us"] for v in per_kernel.values()) / 1e3
    return results


def _step_prefix(args: argparse.Namespace, model: str, mult: int | str, mode: str) -> Path | None:
    """``DIR/<model>[-vocab<N>]-x<mult>-<mode>``: where a step's files go under ``--save-hlo DIR``
    (the ``--target`` run's names), None without it."""
    return Path(args.save_hlo) / f"{model}{vocab_tag(args.vocab)}-x{mult}-{mode}" if args.save_hlo else None


def _task(model: str, smoke: bool, mult: int, vocab: int | None = None) -> Task:
    """The model's task with real arrays, its batch ``mult`` times as large (a GPT's
    vocabulary ``vocab``, None: its own)."""
    task = make_task(model, smoke=smoke, vocab=vocab).materialise()
    return dataclasses.replace(task, batch=_tiled(task.batch, mult)) if mult != 1 else task


def _child(args: argparse.Namespace) -> None:
    """One system in a fresh process: its peak device memory is its own."""
    model, name, mult, mode = args._child
    t0 = time.perf_counter()
    task = _task(model, args.smoke, int(mult), args.vocab)
    task_s = time.perf_counter() - t0
    res = measure_in_process(
        task,
        [name],
        warmup=args.warmup,
        repeats=args.repeats,
        mode=mode,
        hlo_prefix=_step_prefix(args, model, mult, mode),
        kernel_times=args.kernel_times,
    )[name]
    res["peak_bytes"] = C.device_peak_bytes()
    # where a lease's minutes go: the process's start (Python, imports, the backend), the
    # model's arrays, the step (trace, compile, steps); the parent adds the whole process
    start = time.time() - float(os.environ.get("AUTOCAST_GPU_LAUNCH", "nan")) - (time.perf_counter() - t0)
    res["phases_s"] = {"start": start, "task": task_s, "measure": time.perf_counter() - t0 - task_s}
    grads = res.pop("grads0", None)
    if grads is not None and os.environ.get("AUTOCAST_GPU_GRADS"):
        np.savez(
            os.environ["AUTOCAST_GPU_GRADS"], *[np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads)]
        )
    print(json.dumps(res, default=str))


def measure_isolated(
    args: argparse.Namespace,
    model: str,
    names: list[str],
    mult: int,
    mode: str,
    tmp: Path,
    on_result: Callable[[dict[str, Any]], None] | None = None,
):
    """Every system in its own process (peak device memory per system); gradients come
    back through ``.npz`` files in ``tmp`` (only where fp32's is there to compare with).
    The processes share a persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, in
    ``tmp`` unless set): the model's initialisation, the same program in each, is compiled
    once (on an H200 it took about half of each process's time). ``on_result`` is called
    with the results so far after each system (a run cut short keeps them)."""
    results: dict[str, Any] = {}
    for name in names:
        grads_path = tmp / f"{model}-{name}.npz"
        cmd = [sys.executable, "-m", "benchmarks.gpu_measured.gpu", "--_child", model, name, str(mult), mode]
        cmd += ["--warmup", str(args.warmup), "--repeats", str(args.repeats)] + (["--smoke"] if args.smoke else [])
        cmd += ["--save-hlo", args.save_hlo] if args.save_hlo else []
        cmd += ["--kernel-times"] if args.kernel_times else []
        cmd += ["--vocab", str(args.vocab)] if args.vocab else []
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp / "jax-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
        if "fp32" in names:
            env["AUTOCAST_GPU_GRADS"] = str(grads_path)
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        env["AUTOCAST_GPU_LAUNCH"] = repr(time.time())
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res["phases_s"]["process"] = time.perf_counter() - t0
        except (IndexError, ValueError):
            res = {"error": (proc.stderr.strip().splitlines() or ["child failed"])[-1][:300]}
        if grads_path.exists():
            with np.load(grads_path) as z:
                res["grads0"] = [z[k] for k in sorted(z.files, key=lambda s: int(s.split("_")[1]))]
            grads_path.unlink()
        results[name] = res
        print(f"{model} x{mult} {mode} {name}: {_summary(res)}", flush=True)
        if on_result is not None:
            on_result({k: {f: v for f, v in r.items() if f != "grads0"} for k, r in results.items()})
    return results


def _summary(res: dict[str, Any]) -> str:
    if "error" in res:
        return res["error"]
    line = f"{res['median_step_s'] * 1e3:.2f} ms measured"
    if "pipelined_step_s" in res:
        line += f" ({res['pipelined_step_s'] * 1e3:.2f} ms back to back)"
    if "roofline" in res:
        line += f", {res['roofline']['time_s'] * 1e3:.2f} ms modeled"
    return line + f", compile {res['compile_s']:.0f} s"


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


def _fmha_cell(res: dict[str, Any]) -> str:
    f = res.get("fused_attention")
    return "-" if not f else f"{f['forward']} / {f['backward']}"


def _vs(r: dict[str, Any], base: dict[str, Any] | None, key: str) -> str:
    """``r`` 's time over ``base`` 's: measured (each step waited for / steps back to back),
    and (on a GPU) modeled in brackets."""
    if not base or "error" in base or "error" in r:
        return "-"
    cell = f"{r['median_step_s'] / base['median_step_s']:.2f}x"
    if r.get("pipelined_step_s") and base.get("pipelined_step_s"):
        cell += f" / {r['pipelined_step_s'] / base['pipelined_step_s']:.2f}x"
    if "roofline" in r and "roofline" in base:
        cell += f" ({r['roofline'][key] / base['roofline'][key]:.2f}x)"
    return cell


def table(title: str, desc: str, results: dict[str, dict[str, Any]], backend: str) -> str:
    """One (model, batch, mode) section: measured step time next to the modeled one (a GPU),
    ratios to fp32 and MPX (measured, modeled in brackets), memory, gradient error, fp8; and
    where kernels were profiled (``--kernel-times`` on a GPU), the GPU time of a step."""
    fp32, mpx = results.get("fp32"), results.get("mpx-bf16")
    profiled = any(r.get("profiled_gpu_ms") for r in results.values())
    rows = [
        f"### {title}\n\n{desc}\n",
        "| system | median step time | back to back | modeled (roofline) | measured / modeled | vs fp32 "
        "| vs MPX bf16 | peak device memory | step-0 gradient error vs fp32 | fp8 GEMMs | cuDNN attention (fwd / bwd) |"
        + (" GPU time (profiled kernels) |" if profiled else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if profiled else ""),
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error']} | | | | | | | | | |" + (" |" if profiled else ""))
            continue
        t = r.get("median_step_s")
        piped = r.get("pipelined_step_s")
        model_t = r.get("roofline", {}).get("time_s")
        peak = r.get("peak_bytes")
        err = r.get("grad_err_vs_fp32")
        err_cell = "non-finite (step skipped by the loss scaler)" if err is None and "grad_err_vs_fp32" in r else None
        rows.append(
            f"| {name} | {_fmt(t and t * 1e3, '.2f', ' ms')} | {_fmt(piped and piped * 1e3, '.2f', ' ms')} | "
            f"{_fmt(model_t and model_t * 1e3, '.2f', ' ms')} | "
            f"{_fmt(t / model_t if t and model_t else None, '.2f', 'x')} | {_vs(r, fp32, 'time_s')} | "
            f"{_vs(r, mpx, 'time_s')} | {'n/a' if peak is None else C.fmt_bytes(peak)} | "
            f"{err_cell or _fmt(err, '.2e')} | {_fp8_cell(r, backend)} | {_fmha_cell(r)} |"
            + (f" {_fmt(r.get('profiled_gpu_ms'), '.2f', ' ms')} |" if profiled else "")
        )
    return "\n".join(rows)


def _section(title: str, desc: str, res: dict[str, dict[str, Any]], backend: str, report: dict[str, Any]) -> str:
    """A section's table: :func:`benchmarks.gpu_measured.rounds.table` for a ``--rounds`` run, else :func:`table`."""
    if report["args"].get("rounds") is not None:
        return R.table(title, desc, res, _fmha_cell)
    return table(title, desc, res, backend)


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
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS + EXTRA_SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per system (default 20; smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per system (default 3; smoke 1)")
    ap.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="each system in its own process, for its peak device memory (auto: on a GPU/TPU)",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where the results go (default: benchmarks/results/gpu_measured; --target: gpu_modeled)",
    )
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
        help="write each step's optimised HLO (gzipped) there: <model>-x<mult>-<mode>-<system>.hlo.gz "
        "(for python -m benchmarks.gpu_modeled.kernel_breakdown, or with --target benchmarks.gpu_modeled.deviceless --reanalyse)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        default=None,
        help="XLA:GPU GEMM modes: triton (XLA's default) and cublas (every GEMM a cuBLAS call); "
        "default both on a GPU and with --target, triton alone elsewhere",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="--target with --save-hlo: take a step's figures from DIR/<step>.json where an earlier run wrote them",
    )
    ap.add_argument(
        "--batch-mults",
        nargs="+",
        type=int,
        default=None,
        help="batch sizes as multiples of each model's (default: 1 4 with --target, 1 measured; the 1B GPT: 1 only)",
    )
    ap.add_argument(
        "--kernel-times",
        action="store_true",
        help="with --save-hlo: profile one more step of each system, its GPU time per kernel to "
        "DIR/<step>-<system>.kernels.json (python -m benchmarks.gpu_measured.kernel_times compares it with the model)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="compile every system first, in one process, then time them in this many rotated rounds "
        "(benchmarks/gpu_measured/rounds.py); default: the interleaved steps above",
    )
    ap.add_argument("--round-steps", type=int, default=5, help="with --rounds: steps back to back per turn")
    ap.add_argument("--compile-threads", type=int, default=1, help="with --rounds: programs compiled at once")
    ap.add_argument("--stop-rounds-at", type=float, default=None, help="with --rounds: no round after (epoch s)")
    ap.add_argument(
        "--largest-batch",
        action="store_true",
        help="the --batch-mults in increasing order, none after one at which every system failed (out of "
        "memory): the last batch measured is the largest that fits",
    )
    ap.add_argument(
        "--vocab",
        type=int,
        default=None,
        metavar="N",
        help="the GPT models' vocabulary (default: their own, 50257; Llama 3: 128256, Gemma: 256000); "
        "in the report and its file name",
    )
    ap.add_argument("--_child", nargs=4, metavar=("MODEL", "SYSTEM", "MULT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = args.models or list(TARGET_MODELS if args.target else DEFAULT_MODELS)
    args.batch_mults = args.batch_mults or ([1, 4] if args.target else [1])
    if args.modes is None:
        args.modes = list(MODES) if args.target or args._child or jax.default_backend() == "gpu" else ["triton"]
    args.repeats = args.repeats if args.repeats is not None else (3 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    if args.vocab is not None:
        if args.vocab < 2:
            ap.error(f"--vocab: got {args.vocab}; must be an integer >= 2")
        if other := [m for m in args.models if m not in GPT_MODELS]:
            ap.error(f"--vocab: only the GPT models ({', '.join(GPT_MODELS)}) have a vocabulary; got --models {other}")
    if args.largest_batch:
        if args.target:
            ap.error("--largest-batch: steps that run (not with --target, which only compiles)")
        args.batch_mults = sorted(set(args.batch_mults))
    if args.kernel_times and not args.save_hlo:
        ap.error("--kernel-times: needs --save-hlo DIR (the kernel times are saved beside each step's HLO)")
    if any(m < 1 for m in args.batch_mults):
        ap.error(f"--batch-mults: got {args.batch_mults}; each must be an integer >= 1")
    if args.rounds is not None and (args.isolate == "yes" or args.kernel_times or args.target):
        ap.error("--rounds: all systems in one process (not with --isolate yes, --kernel-times or --target)")
    checks = [("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0), ("--round-steps", args.round_steps, 1)]
    checks += [
        ("--rounds", 1 if args.rounds is None else args.rounds, 1),
        ("--compile-threads", args.compile_threads, 1),
    ]
    for flag, v, low in checks:
        if v < low:
            ap.error(f"{flag}: got {v}; must be an integer >= {low}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns what it writes to the ``.json`` file."""
    global _compiler_options
    args = _parse(argv)
    _compiler_options = SMOKE_COMPILE if args.smoke and jax.default_backend() == "cpu" else None
    if args._child:
        _child(args)
        return {}
    cmd = " ".join(["python -m benchmarks.gpu_measured.gpu", *(argv if argv is not None else sys.argv[1:])])
    if args.target:
        from benchmarks.gpu_modeled import deviceless

        names = [n for n in args.systems if n != "mpx-bf16" or mpx_available()]
        skipped = ["- mpx-bf16: skipped, `mpx` is not importable here."] if len(names) < len(args.systems) else []
        return deviceless.run(args, cmd, names, skipped)
    t0 = time.perf_counter()
    meta = C.metadata()
    backend = jax.default_backend()
    device = jax.devices()[0].device_kind
    isolate = args.rounds is None and (args.isolate == "yes" or (args.isolate == "auto" and backend != "cpu"))
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
    out_dir = Path(args.out_dir) if args.out_dir else C.results_dir("gpu_measured")
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or backend
    stem = out_dir / f"gpu-{slug}{vocab_tag(args.vocab)}-{date}{'-smoke' if args.smoke else ''}"
    print(f"GPU benchmark on {backend} ({device}), jax {jax.__version__}; models {args.models}, systems {names}")
    report: dict[str, Any] = {"command": cmd, "meta": meta, "args": vars(args), "smoke": args.smoke, "models": {}}
    report["isolated"] = isolate
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            made: list[Task] = []  # the model's task, made once for all its batches (measured in this process)

            def task_at(mult: int, model=model, made=made) -> Task:
                made[:] = made or [_task(model, args.smoke, 1, args.vocab)]
                return dataclasses.replace(made[0], batch=_tiled(made[0].batch, mult))

            for mult in [1] if model in X1_ONLY else args.batch_mults:
                if args.largest_batch and _failed_every_system(report["models"].get(model, {})):
                    break  # a smaller batch failed for every system
                for mode in args.modes:
                    title = f"{model}, x{mult}, {mode} GEMMs"
                    desc = make_task(model, smoke=args.smoke, shapes_only=True, vocab=args.vocab).description
                    desc = desc.replace(" (shapes only)", "")
                    desc = re.sub(r"batch (\d+)", lambda m, k=mult: f"batch {int(m[1]) * k}", desc)
                    entry = report["models"].setdefault(model, {"description": desc, "runs": {}})

                    def record(
                        res: dict, final: bool = False, entry=entry, title=title, desc=desc, key=f"x{mult}-{mode}"
                    ):
                        # the section into the report, written at once (a run cut short keeps what it
                        # has); before all its systems are measured, marked "so far" and replaced later
                        entry["runs"][key] = {"description": desc, "results": res} | (
                            {} if final else {"partial": True}
                        )
                        report["notes"], report["wall_time_s"] = notes, time.perf_counter() - t0
                        section = _section(title if final else title + " (so far)", desc, res, backend, report)
                        if final:
                            sections.append(section)
                            print(section, flush=True)
                        _write(stem, report, sections if final else [*sections, section])

                    if args.rounds is not None:
                        res = R.measure_resident(
                            _task(model, args.smoke, mult, args.vocab),
                            names,
                            rounds=args.rounds,
                            steps=args.round_steps,
                            warmup=args.warmup,
                            mode=mode,
                            hlo_prefix=_step_prefix(args, model, mult, mode),
                            compile_threads=args.compile_threads,
                            stop_at=args.stop_rounds_at,
                            on_result=record,
                        )
                    elif isolate:
                        res = measure_isolated(args, model, names, mult, mode, Path(tmp), record)
                    else:
                        res = measure_in_process(
                            task_at(mult),
                            names,
                            warmup=args.warmup,
                            repeats=args.repeats,
                            mode=mode,
                            hlo_prefix=_step_prefix(args, model, mult, mode),
                            kernel_times=args.kernel_times,
                            copy=True,  # the model serves every batch
                        )
                    ref = res.get("fp32", {}).get("grads0")
                    for r in res.values():
                        g = r.pop("grads0", None)
                        if g is not None and ref is not None:
                            r["grad_err_vs_fp32"] = _rel_err(g, ref)
                    record(res, final=True)
            if args.largest_batch and model in report["models"]:
                notes.append(_largest_batch_note(model, report["models"][model], args.batch_mults))
                _write(stem, report, sections)
    print(f"wrote {stem}.md and .json ({report['wall_time_s']:.0f} s)")
    report["paths"] = [str(stem.with_suffix(".md")), str(stem.with_suffix(".json"))]
    return report


def _failed_every_system(entry: dict[str, Any]) -> bool:
    """A model's report ``entry`` holds a batch (and GEMM mode) at which every system failed
    (out of memory, most often): ``--largest-batch`` tries no larger one."""
    return any(
        run_["results"] and all("error" in r for r in run_["results"].values())
        for run_ in entry.get("runs", {}).values()
    )


def _largest_batch_note(model: str, entry: dict[str, Any], mults: list[int]) -> str:
    """``--largest-batch``'s finding for ``model``: per system, the largest batch multiple at which
    its step ran (every GEMM mode), and the first at which it failed, with the error."""
    ran: dict[str, list[int]] = {}
    failed: dict[str, tuple[int, str]] = {}
    for key, run_ in entry["runs"].items():
        mult = int(key.split("-", 1)[0][1:])
        for name, r in run_["results"].items():
            if "error" in r:
                failed.setdefault(name, (mult, r["error"]))
            elif name not in failed:
                ran.setdefault(name, []).append(mult)
    cells = []
    for name in dict.fromkeys([*ran, *failed]):
        ok = f"x{max(ran[name])}" if name in ran else "none"
        cells.append(
            f"{name} {ok}"
            + (f" (x{failed[name][0]} failed: {failed[name][1][:120]})" if name in failed else " (no failure)")
        )
    tried = [m for m in mults if any(k.startswith(f"x{m}-") for k in entry["runs"])]
    return (
        f"- `--largest-batch`, {model} (batch multiples tried: {', '.join(f'x{m}' for m in tried)}): the largest "
        f"that ran: {'; '.join(cells)}."
    )


def _write(stem: Path, report: dict[str, Any], sections: list[str]) -> None:
    """The report as ``stem.json`` and ``stem.md`` (``sections``: its tables)."""
    C.write_json(stem.with_suffix(".json"), report)
    wall, notes = report["wall_time_s"], report.get("notes", [])
    args, backend, device = report["args"], report["meta"]["backend"], report["meta"].get("device", "")
    chip = next((r["roofline"]["chip"] for e in report["models"].values() for run in e["runs"].values()
                 for r in run["results"].values() if "roofline" in r), None)  # fmt: skip
    rounds = args.get("rounds")
    modeled = (
        f"Modeled: the roofline of the very program timed (its optimised HLO, `benchmarks/gpu_modeled/hlo_model.py`, at the "
        f"{chip}'s datasheet rates: per kernel max(HBM bytes / bandwidth, GEMM FLOPs / peak) + 2 us), "
        + ("in the .json (`roofline`). " if rounds is not None else "the ratio to fp32 and MPX in brackets. ")
        + "The step is the `--target` report's (inputs donated, GEMM mode) that also returns its gradient.\n\n"
        if chip
        else ""
    )
    if rounds is not None:
        how = (
            f"{args['warmup']} warm-up steps, then {rounds} rotated rounds of {args['round_steps']} steps per system, "
            f"all systems compiled first ({args['compile_threads']} at a time) and resident in one process\n\n"
            + R.METHOD
            + "\n\n"
        )
    else:
        how = (
            f"{args['warmup']} warm-up and {args['repeats']} timed steps per system, "
            f"{'each system in its own process' if report['isolated'] else 'all systems in one process, interleaved'}"
            "\n\nStep times: the median of steps each waited for (the host's work per call included), and "
            "back to back: steps dispatched without waiting, only the last waited for (the host prepares the "
            "next call while the device runs; about the device's time per step). Ratios to fp32 and MPX: "
            "waited-for / back-to-back.\n\n"
        )
    md = (
        f"## Training-step benchmark ({backend}: {device})\n\nCommand: `{report['command']}`\n\n"
        f"{C.metadata_markdown(report['meta'])}"
        f"- wall time: {wall / 60:.1f} min; "
        + how
        + "Gradient error: relative L2 error of the step-0 gradient (all parameters) against fp32's, same "
        "parameters and batch. fp8 GEMMs: cuBLASLt float8 GEMM custom calls in the compiled step (GPU), "
        "dot_generals with float8_e4m3fn operands in the lowered StableHLO.\n\n"
        + modeled
        + ("\n".join(notes) + "\n\n" if notes else "")
        + "\n\n".join(sections)
        + "\n"
    )
    stem.with_suffix(".md").write_text(md)


def reanalyse(json_path: Path, hlo_dir: Path, device_kind: str | None = None) -> None:
    """Recompute the modeled figures of a measured report from the HLO its run saved
    (``--save-hlo DIR``) at the rates of ``device_kind`` (default: the report's device), and
    rewrite its ``.json`` and ``.md``; the measured figures stay as they are."""
    report = json.loads(json_path.read_text())
    chip = hlo_model.chip_for(device_kind or report["meta"]["device"])
    sections = []
    for model, entry in report["models"].items():
        for key, run_ in entry["runs"].items():
            for name, res in run_["results"].items():
                path = hlo_dir / f"{model}{vocab_tag(report['args'].get('vocab'))}-{key}-{name}.hlo.gz"
                if "error" not in res and path.exists():
                    res["roofline"] = hlo_model.roofline(gzip.decompress(path.read_bytes()).decode(), chip)
            mult, mode = key.split("-", 1)
            title = f"{model}, {mult}, {mode} GEMMs"
            sections.append(_section(title, run_["description"], run_["results"], report["meta"]["backend"], report))
    _write(json_path.with_suffix(""), report, sections)
    print(f"rewrote {json_path} and its .md from {hlo_dir} ({chip.name})")


if __name__ == "__main__":
    main()
