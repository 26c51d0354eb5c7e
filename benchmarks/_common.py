"""Shared helpers for the benchmarks: timing, metadata, residual bytes, HLO converts.

Everything here is backend-independent: the same code runs on CPU and GPU, and the
backend is read from ``jax.devices()``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""The benchmarks' results: a folder per question (``results/<question>/``, the package's name),
superseded runs in ``results/archive/<question>/``."""


def results_dir(question: str) -> Path:
    """``RESULTS_DIR / question``, created; ``RESULTS_DIR`` is read at each call, so a test can
    point it elsewhere."""
    path = RESULTS_DIR / question
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The repository's commit (``+dirty`` with uncommitted changes), or, where the caller
    names it in ``AUTOCAST_GIT_COMMIT``, that (a copy of the tree sent to a lent GPU
    machine: its ``.git``, if any, is not the tree's)."""
    import subprocess

    if os.environ.get("AUTOCAST_GIT_COMMIT"):
        return os.environ["AUTOCAST_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        # results written by earlier benchmarks of the same run do not make the code dirty
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def metadata() -> dict[str, Any]:
    """Machine, backend, library versions, repo commit and date (UTC) of this run."""
    dev = jax.devices()[0]
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores" + (f", {mem_gb:.0f} GiB RAM" if mem_gb else ""),
        "os": platform.platform(),
        "backend": jax.default_backend(),
        "device": f"{dev.device_kind} x{len(jax.devices())}",
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "jax_flags": jax_flags(),
        "versions": {
            name: _version(name)
            for name in (
                "jax",
                "jaxlib",
                "equinox",
                "optax",
                "jax-autocast",
                "mixed-precision-for-jax",
                "jmp",
                "jaxamp",
            )
        },
    }


def jax_flags() -> dict[str, bool]:
    """JAX's upgrade flags that are on in this run and change the program a step compiles to
    (``autocast._compat.HIJAX_FLAGS``: how softmax is differentiated, the encodings of
    checkpoint, custom derivatives and scan), as ``{"jax_<name>": True}``."""
    from autocast import _compat

    return {f"jax_{name}": True for name in _compat.HIJAX_FLAGS if _compat.flag_on(name)}


def metadata_markdown(meta: dict[str, Any]) -> str:
    """A short markdown bullet list of :func:`metadata`."""
    vers = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    flags = ", ".join(meta.get("jax_flags") or {})
    return (
        f"- date: {meta['date']}\n"
        f"- machine: {meta['machine']} ({meta['os']})\n"
        f"- backend: {meta['backend']} ({meta['device']})\n"
        f"- python {meta['python']}; {vers}; repo commit {meta.get('git_commit')}\n"
        + (f"- JAX flags on: {flags}\n" if flags else "")
    )


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# ----------------------------------------------------------------------------- timing


def block(tree: Any) -> Any:
    """``jax.block_until_ready`` on every array leaf of ``tree``."""
    return jax.block_until_ready(tree)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn()``, block on its result, return ``(seconds, result)``."""
    t0 = time.perf_counter()
    out = block(fn())
    return time.perf_counter() - t0, out


def interleaved_medians(
    runners: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10
) -> dict[str, dict[str, float]]:
    """Median wall time of each runner, calling the runners round-robin.

    Each runner is called ``warmup`` times (not timed), then ``repeats`` rounds are
    timed, one call of every runner per round, so slow drifts of a shared noisy
    machine hit every runner alike. Returns ``{name: {median, min, iqr, n, times}}`` in
    seconds (``times``: one per round, in round order; see :func:`paired_ratio`).
    """
    for _ in range(warmup):
        for fn in runners.values():
            block(fn())
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            times[name].append(timed(fn)[0])
    out = {}
    for name, ts in times.items():
        q = np.percentile(ts, [25, 75])
        out[name] = {
            "median": statistics.median(ts),
            "min": min(ts),
            "iqr": float(q[1] - q[0]),
            "n": len(ts),
            "times": list(ts),
        }
    return out


def pipelined_medians(
    runners: dict[str, Callable[[], Any]], *, steps: int = 10, rounds: int = 3
) -> dict[str, dict[str, float]]:
    """Seconds per call of each runner when ``steps`` calls are dispatched back to back and
    only the last is waited for (a training loop that does not read each step's loss):
    the host prepares the next call while the device runs the last, so this is the
    device's time per step where the host keeps ahead. Median over ``rounds`` rounds, the
    runners round-robin. Returns ``{name: {median, min, rounds}}``."""
    per: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(steps):
                out = fn()
            block(out)
            per[name].append((time.perf_counter() - t0) / steps)
    return {name: {"median": statistics.median(ts), "min": min(ts), "rounds": len(ts)} for name, ts in per.items()}


def paired_ratio(timing: dict[str, dict[str, Any]], name: str, base: str) -> float:
    """Median over rounds of ``name``'s time / ``base``'s time in the same round (from
    :func:`interleaved_medians`): a ratio that noise common to one round cancels out of."""
    return statistics.median(a / b for a, b in zip(timing[name]["times"], timing[base]["times"]))


def trace_lower_compile(jitted: Any, *args: Any) -> tuple[Any, dict[str, float]]:
    """Trace, lower and compile ``jitted`` (a ``jax.jit`` object) for ``args``.

    Returns ``(lowered, compiled)`` and the wall seconds spent in each stage, plus
    ``total_cpu``: CPU seconds of this process over all three stages (less sensitive
    than wall time to other processes on a shared machine).
    """
    c0 = time.process_time()
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    c3 = time.process_time()
    times = {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2, "total": t3 - t0, "total_cpu": c3 - c0}
    return (lowered, compiled), times


# ----------------------------------------------------------------------------- memory


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def residual_bytes(f: Callable[..., Any], params: Any, *batch: Any) -> dict[str, Any]:
    """Bytes of the residuals that ``jax.vjp`` saves for the backward pass of ``f``.

    ``f(params, *batch)`` must return a scalar (the loss); only ``params`` is
    differentiated. Residuals are read from the jaxpr of ``jax.vjp`` (as
    ``jax.ad_checkpoint.print_saved_residuals`` does), deduplicated, and split into

    - ``activation``: residuals computed from the batch (what mixed precision halves),
    - ``param_derived``: residuals computed from the parameters alone (e.g. the
      half-precision copies of the weights that a cast inside ``f`` creates),
    - ``arguments``: residuals that are inputs of ``f`` (already in memory; not counted).

    This is independent of the backend and of XLA's buffer assignment.
    """

    def _residuals(p, *b):
        _, vjp_fn = jax.vjp(lambda q: f(q, *b), p)
        return jax.tree_util.tree_leaves(vjp_fn)

    closed = jax.make_jaxpr(_residuals)(params, *batch)
    jaxpr = closed.jaxpr
    n_param = len(jax.tree_util.tree_leaves(params))
    batch_vars = set(jaxpr.invars[n_param:])
    invars = set(jaxpr.invars)
    tainted = set(batch_vars)  # vars that depend on the batch
    for eqn in jaxpr.eqns:
        if any((not isinstance(v, jex_core.Literal)) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    out = {"activation": 0, "param_derived": 0, "arguments": 0, "n_residuals": 0}
    by_dtype: dict[str, int] = {}
    seen = set()
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Literal) or v in seen:
            continue
        seen.add(v)
        nb = _nbytes(v.aval)
        if v in invars:
            out["arguments"] += nb
            continue
        out["n_residuals"] += 1
        key = "activation" if v in tainted else "param_derived"
        out[key] += nb
        if key == "activation":
            name = str(v.aval.dtype)
            by_dtype[name] = by_dtype.get(name, 0) + nb
    out["activation_by_dtype"] = by_dtype
    return out


def compiled_memory(compiled: Any) -> dict[str, int] | None:
    """XLA's compiled memory analysis (argument/output/temp/peak bytes), if available."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if ma is None:
        return None
    keys = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "peak_memory_in_bytes",
    )
    return {k.replace("_size_in_bytes", "").replace("_in_bytes", ""): int(getattr(ma, k, 0) or 0) for k in keys}


def device_peak_bytes() -> int | None:
    """``peak_bytes_in_use`` of the first device, where the backend reports it (GPU/TPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    return stats.get("peak_bytes_in_use")


# ----------------------------------------------------------------------------- HLO


_HLO_CONVERT = re.compile(r"=\s*\S+\s+convert\(")


def count_converts(lowered: Any, compiled: Any) -> dict[str, int]:
    """Number of convert ops before (StableHLO, what the program asks for) and after
    XLA optimization (what the backend runs; CPU adds its own f16<->f32 converts)."""
    stablehlo = lowered.as_text()
    optimized = compiled.as_text()
    return {
        "stablehlo": stablehlo.count("stablehlo.convert"),
        "optimized": len(_HLO_CONVERT.findall(optimized)),
    }


def count_eqns(jaxpr: Any) -> int:
    """Number of equations in a (closed) jaxpr, including every sub-jaxpr."""
    from autocast import _compat

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        # bodies in params, and those a ``call_hi_primitive`` (JAX's upgrade flags) holds
        for sub in [*jex_core.jaxprs_in_params(eqn.params), *_compat.hi_bodies(eqn)]:
            n += count_eqns(sub)
    return n


def fmt_bytes(n: float | None) -> str:
    """Human-readable bytes (MiB/GiB)."""
    if n is None:
        return "n/a"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@contextlib.contextmanager
def mpx_half_dtype(dtype):
    """MPX's global half-precision dtype set to ``dtype`` inside the block, restored after."""
    import mpx

    old = mpx.half_precision_datatype()
    mpx.set_half_precision_datatype(dtype)
    try:
        yield
    finally:
        mpx.set_half_precision_datatype(old)
