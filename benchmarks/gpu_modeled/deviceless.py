"""Train steps compiled for a GPU this machine does not have, and the ``--target`` report.

``python -m benchmarks.gpu_measured.gpu --target h100`` (``bash benchmarks/gpu_measured/run_gpu.sh --target h100``).
XLA compiles for an NVIDIA GPU described by a target file (``benchmarks/gpu_modeled/targets/``) on a
machine without one, through the jax-cuda plugin's topology API ("deviceless"): what comes
back is the optimised HLO and XLA:GPU's buffer assignment, with no autotuning (GEMM
configurations are XLA's defaults) and nothing run. Compare systems within one GEMM mode,
never across:

- ``triton``: XLA's default (GEMMs as Triton fusions where it chooses to);
- ``cublas``: ``xla_gpu_enable_triton_gemm=False`` (every GEMM a cuBLAS(Lt) call).

The models and systems of the measured benchmark (:mod:`benchmarks.models.train_steps`), at its
batch sizes and at ``4x``, each train step (inputs donated: parameters, optimizer state,
scaler) in both GEMM modes. Reported per step: the census (kernels, GEMMs by operand
dtype, fp8 GEMMs, convolutions, cuDNN fused attention calls;
:func:`benchmarks.gpu_modeled.hlo_model.census`), XLA:GPU's memory
analysis (arguments, outputs, aliased, temp, peak), the roofline model of its time on the
target (HBM bytes, GEMM FLOPs, modeled step time; :func:`benchmarks.gpu_modeled.hlo_model.roofline`),
ratios within a mode against fp32 and MPX, and the issue-22 targets met or not.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

from benchmarks import _common as C
from benchmarks.gpu_modeled import hlo_model
from benchmarks.models import train_steps as S

TARGETS = {"h100": "h100_sxm.txtpb"}
MODES = {"triton": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}
_TARGET_DIR = Path(__file__).resolve().parent / "targets"


def _plugin_hint() -> str:
    """What to install (or set) for deviceless CUDA compiles, for an error message."""
    import importlib.util
    import os

    import jaxlib

    v = jaxlib.__version__
    try:
        installed = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        installed = False
    if not installed:
        return (
            f"install the jax-cuda12 plugin matching jaxlib {v} (no GPU or nvidia-* wheels needed): "
            f"pip install --no-deps jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}, "
            "or run bash tests/run_gpu_program.sh, which does"
        )
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return "the jax-cuda12 plugin is installed: set JAX_PLATFORMS=cpu before JAX starts (without a GPU it is not registered otherwise)"
    return f"the jax-cuda12 plugin is installed: check that its version is jaxlib's ({v})"


def target_sharding(target: str) -> Any:
    """A one-device ``NamedSharding`` on the deviceless ``target`` GPU.

    Raises ``RuntimeError`` naming the missing piece when the jax-cuda plugin is absent."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    if target not in TARGETS:
        raise ValueError(f"--target {target!r} unknown; allowed: {sorted(TARGETS)}")
    text = (_TARGET_DIR / TARGETS[target]).read_text()
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - the plugin's absence shows as several exception types
        raise RuntimeError(
            f"--target {target}: cannot compile for a CUDA target here ({type(e).__name__}: {e}); {_plugin_hint()}"
        ) from e
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def abstract(tree: Any, sharding: Any, batch_mult: int = 1) -> Any:
    """``ShapeDtypeStruct`` s of ``tree``'s arrays on ``sharding`` (leading axis times
    ``batch_mult``); PRNG keys and other leaves as they are."""

    def one(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        shape = (x.shape[0] * batch_mult, *x.shape[1:]) if batch_mult != 1 else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)


def memory(compiled: Any) -> dict[str, int]:
    """XLA:GPU's buffer assignment in bytes: ``argument``, ``output``, ``alias`` (outputs
    sharing a donated argument's buffer), ``temp`` and ``peak`` = argument + output + temp
    - alias (what the step holds at once, at most); ``xla_peak``: XLA's own figure from its
    heap simulation (live ranges known: at most ``peak``), where reported."""
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    mem["peak"] = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    mem["xla_peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    return mem


def analyse(compiled: Any) -> dict[str, Any]:
    """A compiled step's census, XLA:GPU's memory analysis and the roofline model (H100 SXM
    rates): ``{**census, "memory": ..., "roofline": ...}``."""
    hlo = compiled.as_text()
    return {**hlo_model.census(hlo), "memory": memory(compiled), "roofline": hlo_model.roofline(hlo)}


# ----------------------------------------------------------------------------- the --target report

# issue 22: amp bf16's peak at least this many times below float32's
PEAK_TARGET = {"vit-base": 3.0, "vit-desktop": 3.0, "gpt2-small": 2.0}
# compiled at batch x1 only (its x1 is 16k tokens; a larger batch costs compile time, not insight)
X1_ONLY = {"gpt-1b"}


def compile_step(task: Any, name: str, mode: str, sharding: Any, batch_mult: int = 1) -> Any:
    """``name`` 's train step for ``task`` compiled for the target (the task's arrays may be
    shapes only: nothing is materialised): parameters, optimizer state and scaler donated."""
    params, static = eqx.partition(task.model, S.is_leaf_array)
    opt = optax.adamw(1e-4, weight_decay=1e-4)
    system = S.build_system(name, task, static, opt)
    state = (*system.init(params, opt), system.scaler)
    args = (*abstract(state, sharding), abstract(task.batch, sharding, batch_mult))
    # the step as users run it: parameters, optimizer state, scaler and loss out (the measured
    # benchmark also returns the gradient, to compare it with float32's; nothing runs here)
    step = lambda *a: system.step(*a)[:4]  # noqa: E731
    with system.context():
        jitted = jax.jit(step, donate_argnums=(0, 1, 2), compiler_options=MODES[mode])
        return jitted.lower(*args).compile()


def compile_system(
    task: Any, name: str, mode: str, sharding: Any, batch_mult: int, hlo_path: Path | None = None
) -> dict[str, Any]:
    """Census, memory and roofline (:func:`analyse`) of :func:`compile_step`; the optimised
    HLO is written to ``hlo_path`` (gzipped) if given."""
    t0 = time.perf_counter()
    compiled = compile_step(task, name, mode, sharding, batch_mult)
    info = analyse(compiled)
    info["compile_s"] = time.perf_counter() - t0
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_bytes(gzip.compress(compiled.as_text().encode()))
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
        "| system | kernels | vs bf16 | GEMMs by operand dtypes | fp8 GEMMs | convolutions | cuDNN attention "
        "(fwd / bwd) | arguments MiB | outputs MiB | aliased MiB | temp MiB | peak MiB | peak vs fp32 | peak vs MPX |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = {s: r for s, r in res.items() if "error" not in r}
    base = {s: ok[s]["memory"]["peak"] for s in ("fp32", "mpx-bf16") if s in ok}
    k16 = ok.get("autocast-bf16", {}).get("kernels")
    for s, r in res.items():
        if "error" in r:
            rows.append(f"| {s} | failed: {r['error']} |" + " |" * 12)
            continue
        m = r["memory"]
        vs16 = f"{r['kernels'] / k16:.2f}x" if k16 else "n/a"
        rows.append(
            f"| {s} | {r['kernels']} | {vs16} | {_gemm_cell(r['gemms'])} | "
            f"{r['fp8_gemms']} | {_gemm_cell(r['convolutions']) or '-'} | "
            f"{r.get('fmha_forward', 0)} / {r.get('fmha_backward', 0)} | {_mib(m['argument'])} | {_mib(m['output'])} | "
            f"{_mib(m['alias'])} | {_mib(m['temp'])} | {_mib(m['peak'])} | {_ratio(m['peak'], base, 'fp32')} | "
            f"{_ratio(m['peak'], base, 'mpx-bf16')} |"
        )
    return "\n".join(rows)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def roofline_table(res: dict[str, dict[str, Any]]) -> str:
    """The roofline model of each system's step: HBM bytes, GEMM FLOPs, kernels, modeled
    time (non-GEMM and GEMM kernels apart), ratios against fp32 and MPX bf16 (this mode)."""
    rows = [
        "| system | HBM GiB | GEMM TFLOP | kernels (GEMM) | modeled ms | non-GEMM ms | GEMM ms | time vs fp32 "
        "| time vs MPX | bytes vs fp32 | bytes vs MPX |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = {s: r["roofline"] for s, r in res.items() if "roofline" in r}
    base = {b: ok[b] for b in ("fp32", "mpx-bf16") if b in ok}

    def vs(r: dict[str, Any], b: str, key: str) -> str:
        return f"{r[key] / base[b][key]:.2f}" if b in base else "n/a"

    for s, r in ok.items():
        rows.append(
            f"| {s} | {_gib(r['hbm_bytes'])} | {r['gemm_flops'] / 1e12:,.1f} | {r['kernels']} ({r['gemm_kernels']}) | "
            f"{r['time_s'] * 1e3:,.2f} | {r['other_time_s'] * 1e3:,.2f} | {r['gemm_time_s'] * 1e3:,.2f} | "
            f"{vs(r, 'fp32', 'time_s')} | {vs(r, 'mpx-bf16', 'time_s')} | {vs(r, 'fp32', 'hbm_bytes')} | "
            f"{vs(r, 'mpx-bf16', 'hbm_bytes')} |"
        )
    return "\n".join(rows)


def summary_table(report: dict[str, Any]) -> str:
    """One row per model, batch and mode: each system's modeled step time and HBM bytes."""
    systems = list(
        dict.fromkeys(s for e in report["models"].values() for r in e["runs"].values() for s in r["results"])
    )
    rows = [
        "| model | batch | mode | " + " | ".join(f"{s} ms · GiB" for s in systems) + " | amp bf16 / fp32 time "
        "| amp bf16 / MPX time |",
        "|---|---|---|" + "---|" * (len(systems) + 2),
    ]
    for model, entry in report["models"].items():
        for key, run_ in entry["runs"].items():
            mult, mode = key.split("-", 1)
            rl = {s: r["roofline"] for s, r in run_["results"].items() if "roofline" in r}
            cells = [
                f"{rl[s]['time_s'] * 1e3:,.1f} · {_gib(rl[s]['hbm_bytes'])}" if s in rl else "n/a" for s in systems
            ]
            bf = rl.get("autocast-bf16")
            ratios = [
                f"{bf['time_s'] / rl[b]['time_s']:.2f}" if bf and b in rl else "n/a" for b in ("fp32", "mpx-bf16")
            ]
            rows.append(f"| {model} | {mult} | {mode} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(rows)


ROOFLINE_NOTE = (
    "**Modeled step time (a model, not a measurement).** From the optimised HLO of each step, per launched kernel: "
    "HBM bytes = its operands' bytes + its result's bytes (a cuBLAS/cuDNN call's workspace left out); GEMM FLOPs = "
    "2·|output|·K (K the contracted size) for cuBLAS calls, Triton GEMM fusions and convolutions, and for cuDNN's "
    "fused attention its products over the scores it keeps (forward 2·B·N·T·S·(Hqk + Hv), backward "
    "2·B·N·T·S·(3·Hqk + 2·Hv)); time = max(bytes / "
    "3.35 TB/s, FLOPs / peak) + 2 µs, with H100 SXM dense peaks 989 TFLOP/s for bf16/f16 operands, 1979 for "
    "float8, 495 (TF32) for float32. It ignores caches (L2 hits count as HBM traffic), overlap between kernels, "
    "partial reads of sliced operands (charged in full) and the gap between achieved and peak GEMM rates; without "
    "autotuning the GEMM configurations (Triton split-K and its float32 partial sums) are XLA's defaults. "
    "Non-GEMM ms: the kernels without GEMM work (elementwise, reductions, copies, the optimizer update)."
)


def render(report: dict[str, Any]) -> str:
    """The markdown report of a ``--target`` run's JSON report."""
    sections, verdicts = [], []
    for model, entry in report["models"].items():
        for key, run_ in entry["runs"].items():
            mult, mode = key.split("-", 1)
            sections.append(table(model, int(mult[1:]), mode, run_["results"]))
            if any("roofline" in r for r in run_["results"].values()):
                sections.append("Roofline model:\n\n" + roofline_table(run_["results"]))
            if run_["targets"]:
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
        f"- wall time: {report['wall_time_s'] / 60:.1f} min\n"
        + (f"- the GPT models' vocabulary: {report['vocab']:,} (`--vocab`)\n" if report.get("vocab") else "")
        + "\n**Compile-time facts.** Nothing ran: no timings. Without a device XLA does not autotune, "
        "so GEMM configurations are its defaults; compare systems within one mode (Triton: XLA's default; "
        "cuBLAS: `xla_gpu_enable_triton_gemm=False`), never across modes. Kernels: the entry computation's "
        "instructions that launch work (fusions, custom calls, copies). Memory: XLA:GPU's buffer assignment "
        "for the step with parameters, optimizer state and scaler donated (aliased to the outputs); "
        "peak = what the step holds at once (arguments + temp + outputs not aliased to arguments).\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + f"### Modeled step time on an H100 SXM (roofline)\n\n{ROOFLINE_NOTE}\n\n{summary_table(report)}\n\n"
        + (f"### Targets (issue 22)\n\n{vtable}\n\n" if keys else "")
        + "### Per model, batch and mode\n\n"
        + "\n\n".join(sections)
        + "\n"
    )


def run(args: Any, cmd: str, names: list[str], notes: list[str]) -> dict[str, Any]:
    """The ``--target`` benchmark; writes ``benchmarks/results/gpu_modeled/gpu-target-<target>-<date>.{md,json}``."""
    t0 = time.perf_counter()
    sharding = target_sharding(args.target)
    meta = C.metadata()
    vocab = getattr(args, "vocab", None)  # a GPT's vocabulary (--vocab; None: its own)
    report: dict[str, Any] = {"command": cmd, "meta": meta, "target": args.target, "vocab": vocab, "models": {}}
    save = Path(args.save_hlo) if getattr(args, "save_hlo", None) else None
    loaded: dict[str, int] = {}
    for model in args.models:
        # compiled from shapes: no parameters made
        task = S.make_task(model, smoke=args.smoke, shapes_only=True, vocab=vocab)
        report["models"][model] = {"description": task.description, "runs": {}}
        for mult in [1] if model in X1_ONLY else args.batch_mults:
            for mode in getattr(args, "modes", None) or MODES:
                res = {}
                for name in names:
                    key = f"{model}{S.vocab_tag(vocab)}-x{mult}-{mode}-{name}"
                    figures = save / f"{key}.json" if save else None
                    if figures is not None and getattr(args, "resume", False) and figures.exists():
                        res[name] = json.loads(figures.read_text())
                        commit = res[name].pop("git_commit", None)
                        loaded[str(commit)] = loaded.get(str(commit), 0) + 1
                        print(f"{key}: from {figures}", flush=True)
                        continue
                    try:
                        res[name] = compile_system(
                            task, name, mode, sharding, mult, save / f"{key}.hlo.gz" if save else None
                        )
                    except Exception as e:  # noqa: BLE001 - a failing system is a result
                        res[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                    if figures is not None and "error" not in res[name]:
                        figures.write_text(json.dumps({**res[name], "git_commit": meta.get("git_commit")}))
                    print(
                        f"{model} x{mult} {mode} {name}: "
                        + (
                            res[name].get("error")
                            or f"{res[name]['kernels']} kernels, peak {_mib(res[name]['memory']['peak'])} MiB, "
                            f"modeled {res[name]['roofline']['time_s'] * 1e3:.2f} ms, "
                            f"{_gib(res[name]['roofline']['hbm_bytes'])} GiB ({res[name]['compile_s']:.0f} s)"
                        ),
                        flush=True,
                    )
                checks = _checks(model, res) if model in PEAK_TARGET else {}
                report["models"][model]["runs"][f"x{mult}-{mode}"] = {"results": res, "targets": checks}
    if loaded:
        notes = [
            *notes,
            f"- `--resume`: {sum(loaded.values())} steps' figures taken from `{save}` where earlier processes "
            "compiled them (commit " + ", ".join(f"{c}: {n}" for c, n in loaded.items()) + "); the rest compiled here.",
        ]
    wall = time.perf_counter() - t0
    report["wall_time_s"] = wall
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out_dir = Path(args.out_dir) if args.out_dir else C.results_dir("gpu_modeled")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = re.sub(r"[^a-z0-9]+", "-", args.target) + S.vocab_tag(vocab)
    stem = out_dir / f"gpu-target-{target}-{date}{'-smoke' if args.smoke else ''}"
    report["notes"] = notes
    C.write_json(stem.with_suffix(".json"), report)
    stem.with_suffix(".md").write_text(render(report))
    print(f"wrote {stem}.md and .json ({wall:.0f} s)")
    report["paths"] = [str(stem.with_suffix(".md")), str(stem.with_suffix(".json"))]
    return report


def reanalyse(json_path: Path, hlo_dir: Path) -> None:
    """Recompute the roofline of every step of a ``--target`` report from the HLO a run
    saved (``--save-hlo DIR``), and rewrite the report's ``.json`` and ``.md``: a change of
    the model without compiling again. The census and memory figures stay as compiled."""
    report = json.loads(json_path.read_text())
    for model, entry in report["models"].items():
        for key, run_ in entry["runs"].items():
            for name, res in run_["results"].items():
                path = hlo_dir / f"{model}{S.vocab_tag(report.get('vocab'))}-{key}-{name}.hlo.gz"
                if "error" not in res:
                    res["roofline"] = hlo_model.roofline(gzip.decompress(path.read_bytes()).decode())
    C.write_json(json_path, report)
    json_path.with_suffix(".md").write_text(render(report))
    print(f"rewrote {json_path} and its .md from {hlo_dir}")


def merge(parts: list[Path], out: Path) -> dict[str, Any]:
    """One ``--target`` report of several runs that compiled different models at the same
    commit (e.g. one process per model, in parallel): models in :data:`train_steps.TARGET_MODELS`
    order, the commands and wall times of every part. Writes ``out`` ``.json`` and ``.md``."""
    reports = [json.loads(p.read_text()) for p in parts]
    commits = {r["meta"].get("git_commit") for r in reports}
    if len(commits) != 1 or len({r["target"] for r in reports}) != 1:
        raise ValueError(f"parts from different commits or targets: {commits}")
    models = {m: e for r in reports for m, e in r["models"].items()}
    order = [m for m in S.TARGET_MODELS if m in models] + [m for m in models if m not in S.TARGET_MODELS]
    merged = {
        "command": " & ".join(r["command"] for r in reports),
        "meta": min((r["meta"] for r in reports), key=lambda m: m["date"]),
        "target": reports[0]["target"],
        "models": {m: models[m] for m in order},
        "wall_time_s": max(r["wall_time_s"] for r in reports),
        "notes": list(dict.fromkeys(n for r in reports for n in r.get("notes", [])))
        + [
            f"- Run as {len(reports)} processes in parallel (the commands above, joined by `&`), one per model "
            "group, merged by `python -m benchmarks.gpu_modeled.deviceless --merge`; wall time: the longest, "
            + ", ".join(f"{r['wall_time_s'] / 60:.1f} min ({', '.join(r['models'])})" for r in reports)
            + "."
        ],
    }
    C.write_json(out.with_suffix(".json"), merged)
    out.with_suffix(".md").write_text(render(merged))
    print(f"wrote {out}.md and .json")
    return merged


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Rework --target reports: recompute the roofline, or merge runs.")
    ap.add_argument("--reanalyse", type=Path, help="a --target report's .json: recompute its roofline (--hlo-dir)")
    ap.add_argument("--hlo-dir", type=Path, help="the HLO its run saved (--save-hlo)")
    ap.add_argument("--merge", nargs="+", type=Path, help="--target reports (.json) of different models, one commit")
    ap.add_argument("--out", type=Path, help="--merge: the merged report's path without suffix")
    a = ap.parse_args()
    if a.merge:
        if a.out is None:
            ap.error("--merge needs --out")
        merge(a.merge, a.out)
    if a.reanalyse:
        if a.hlo_dir is None:
            ap.error("--reanalyse needs --hlo-dir")
        reanalyse(a.reanalyse, a.hlo_dir)
