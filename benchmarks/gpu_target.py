"""``python -m benchmarks.gpu --target h100``: the GPU benchmark's steps compiled for a GPU
this machine does not have (see :mod:`benchmarks._gpu_target`).

Same models and systems as the measured benchmark, at its batch sizes and at ``4x``; each
train step (inputs donated: parameters, optimizer state, scaler) compiled in both GEMM
modes. Reported: kernels, GEMMs by operand dtype, fp8 GEMMs, convolutions by operand
dtype, XLA:GPU's memory analysis (arguments, outputs, aliased, temp, peak), ratios within a
mode against fp32 and MPX, and the issue-22 targets met or not. Compile-time facts, no
timings: nothing runs, and without a device XLA does not autotune.
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

from benchmarks import _common as C
from benchmarks import _gpu_target as T

# issue 22: amp bf16's peak at least this many times below float32's
PEAK_TARGET = {"vit-base": 3.0, "vit-desktop": 3.0, "gpt2-small": 2.0}


def compile_system(task: Any, name: str, mode: str, sharding: Any, batch_mult: int) -> dict[str, Any]:
    """Census and memory of ``name`` 's train step for ``task`` on the target, or ``error``."""
    from benchmarks.gpu import build_system

    params, static = eqx.partition(task.model, eqx.is_array)
    opt = optax.adamw(1e-4, weight_decay=1e-4)
    system = build_system(name, task, static, opt)
    state = (params, jax.eval_shape(opt.init, params), system.scaler)
    args = (*T.abstract(state, sharding), T.abstract(task.batch, sharding, batch_mult))
    t0 = time.perf_counter()
    # the step as users run it: parameters, optimizer state, scaler and loss out (the measured
    # benchmark also returns the gradient, to compare it with float32's; nothing runs here)
    step = lambda *a: system.step(*a)[:4]  # noqa: E731
    with system.context():
        jitted = jax.jit(step, donate_argnums=(0, 1, 2), compiler_options=T.MODES[mode])
        _, info = T.compile_for_target(jitted, args)
    info["compile_s"] = time.perf_counter() - t0
    return info


def _checks(model: str, res: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The issue-22 targets for one model, batch and mode (None: a system is missing)."""

    def get(s, *keys):
        v = res.get(s)
        for k in keys:
            v = None if v is None or "error" in v else v.get(k)
        return v

    k8, k16 = get("autocast-fp8", "kernels"), get("autocast-bf16", "kernels")
    t8, t16 = get("autocast-fp8", "memory", "temp"), get("autocast-bf16", "memory", "temp")
    p8, p16, p32 = (get(s, "memory", "peak") for s in ("autocast-fp8", "autocast-bf16", "fp32"))
    amp = [s for s in res if s.startswith("autocast") and "error" not in res[s]]
    return {
        "fp8 kernels <= 1.5x bf16": None if None in (k8, k16) else k8 <= 1.5 * k16,
        "fp8 temp <= bf16 temp": None if None in (t8, t16) else t8 <= t16,
        "bf16 peak >= target x below fp32 (3x ViTs, 2x GPT-2)": (
            None if None in (p16, p32) else p32 >= PEAK_TARGET[model] * p16
        ),
        "fp8 peak < bf16 peak": None if None in (p8, p16) else p8 < p16,
        "no f32-operand convolution in an amp step": all(res[s]["f32_convolutions"] == 0 for s in amp) if amp else None,
    }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def _gemm_cell(g: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(g.items(), key=lambda kv: -kv[1]))


def _ratio(peak: int, base: dict[str, int], b: str) -> str:
    return f"{peak / base[b]:.2f}" if b in base else "n/a"


def table(model: str, mult: int, mode: str, res: dict[str, dict[str, Any]]) -> str:
    rows = [
        f"#### {model}, batch x{mult}, {mode} mode\n",
        "| system | kernels | vs bf16 | GEMMs by operand dtypes | fp8 GEMMs | convolutions | arguments MiB | "
        "outputs MiB | aliased MiB | temp MiB | peak MiB | peak vs fp32 | peak vs MPX |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = {s: r for s, r in res.items() if "error" not in r}
    base = {s: ok[s]["memory"]["peak"] for s in ("fp32", "mpx-bf16") if s in ok}
    k16 = ok.get("autocast-bf16", {}).get("kernels")
    for s, r in res.items():
        if "error" in r:
            rows.append(f"| {s} | failed: {r['error']} |" + " |" * 11)
            continue
        m = r["memory"]
        vs16 = f"{r['kernels'] / k16:.2f}x" if k16 else "n/a"
        rows.append(
            f"| {s} | {r['kernels']} | {vs16} | {_gemm_cell(r['gemms'])} | "
            f"{r['fp8_gemms']} | {_gemm_cell(r['convolutions']) or '-'} | {_mib(m['argument'])} | {_mib(m['output'])} | "
            f"{_mib(m['alias'])} | {_mib(m['temp'])} | {_mib(m['peak'])} | {_ratio(m['peak'], base, 'fp32')} | {_ratio(m['peak'], base, 'mpx-bf16')} |"
        )
    return "\n".join(rows)


def render(report: dict[str, Any]) -> str:
    """The markdown report of a ``--target`` run's JSON report."""
    sections, verdicts = [], []
    for model, entry in report["models"].items():
        for key, run_ in entry["runs"].items():
            mult, mode = key.split("-", 1)
            sections.append(table(model, int(mult[1:]), mode, run_["results"]))
            verdicts.append((model, mult, mode, run_["targets"]))
    keys = list(dict.fromkeys(k for *_, c in verdicts for k in c))
    mark = {True: "met", False: "**not met**", None: "n/a"}
    vtable = "\n".join(
        ["| model | batch | mode | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
        + [f"| {m} | {b} | {mo} | " + " | ".join(mark[c.get(k)] for k in keys) + " |" for m, b, mo, c in verdicts]
    )
    notes = report.get("notes", [])
    return (
        f"## Train steps compiled for {report['target']} without a GPU (deviceless XLA:GPU)\n\n"
        f"Command: `{report['command']}`\n\n{C.metadata_markdown(report['meta'])}"
        f"- wall time: {report['wall_time_s'] / 60:.1f} min\n\n"
        "**Compile-time facts, not speed.** Nothing ran: no timings. Without a device XLA does not autotune, "
        "so GEMM configurations are its defaults; compare systems within one mode (Triton: XLA's default; "
        "cuBLAS: `xla_gpu_enable_triton_gemm=False`), never across modes. Kernels: the entry computation's "
        "instructions that launch work (fusions, custom calls, copies). Memory: XLA:GPU's buffer assignment "
        "for the step with parameters, optimizer state and scaler donated (aliased to the outputs); "
        "peak = what the step holds at once (arguments + temp + outputs not aliased to arguments).\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + (f"### Targets (issue 22)\n\n{vtable}\n\n" if keys else "")
        + "### Per model, batch and mode\n\n"
        + "\n\n".join(sections)
        + "\n"
    )


def run(args: Any, cmd: str, names: list[str], notes: list[str]) -> dict[str, Any]:
    """The ``--target`` benchmark; writes ``benchmarks/results/gpu-target-<target>-<date>.{md,json}``."""
    from benchmarks.gpu import MODELS, SMOKE_MODELS

    t0 = time.perf_counter()
    sharding = T.target_sharding(args.target)
    meta = C.metadata()
    factories = SMOKE_MODELS if args.smoke else MODELS
    report: dict[str, Any] = {"command": cmd, "meta": meta, "target": args.target, "models": {}}
    for model in args.models:
        task = factories[model]()
        report["models"][model] = {"description": task.description, "runs": {}}
        for mult in args.batch_mults:
            for mode in T.MODES:
                res = {}
                for name in names:
                    try:
                        res[name] = compile_system(task, name, mode, sharding, mult)
                    except Exception as e:  # noqa: BLE001 - a failing system is a result
                        res[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                    print(
                        f"{model} x{mult} {mode} {name}: "
                        + (
                            res[name].get("error")
                            or f"{res[name]['kernels']} kernels, peak {_mib(res[name]['memory']['peak'])} MiB"
                        ),
                        flush=True,
                    )
                checks = _checks(model, res) if model in PEAK_TARGET else {}
                report["models"][model]["runs"][f"x{mult}-{mode}"] = {"results": res, "targets": checks}
    wall = time.perf_counter() - t0
    report["wall_time_s"] = wall
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out_dir = Path(args.out_dir) if args.out_dir else C.RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gpu-target-{re.sub(r'[^a-z0-9]+', '-', args.target)}-{date}{'-smoke' if args.smoke else ''}"
    C.write_json(stem.with_suffix(".json"), report)
    report["notes"] = notes
    stem.with_suffix(".md").write_text(render(report))
    print(f"wrote {stem}.md and .json ({wall:.0f} s)")
    report["paths"] = [str(stem.with_suffix(".md")), str(stem.with_suffix(".json"))]
    return report
