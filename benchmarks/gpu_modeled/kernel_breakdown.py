"""Where a compiled train step's modeled time goes, by part of the model, system against system.

``JAX_PLATFORMS=cpu PYTHONPATH=<jax-cuda12 plugin> python -m benchmarks.gpu_modeled.kernel_breakdown``
compiles one train step of a small GPT (the benchmark's GPT-2-small block: width 768, 12
heads, 1,024 tokens, batch 8; ``--depth`` blocks, a ``--vocab`` small enough that the head
does not dominate) for the H100 target without a GPU (:mod:`benchmarks.gpu_modeled.deviceless`), for each
of ``--systems`` (:mod:`benchmarks.models.train_steps`), and groups the roofline model's kernels
(:func:`benchmarks.gpu_modeled.hlo_model.kernel_costs`) by the op name XLA gives each kernel: forward or
backward pass (``transpose(`` in the name), GEMM or not, the part of the model (attention,
layer norm, linear layers, the optimizer update, the rest) and whether the kernel recomputes
forward work in the backward pass (``rematted_computation``). Writes
``benchmarks/results/gpu_modeled/kernel-breakdown[-<label>]-<date>.{md,json}`` (the JAX flag
``jax_softmax_custom_jvp``, which changes how ``jax.nn.softmax`` is differentiated, is
recorded: set ``JAX_SOFTMAX_CUSTOM_JVP=1`` to compare). ``--hlo-dir DIR --step
gpt2-small-x1-cublas`` breaks down full benchmark steps instead: those ``python -m
benchmarks.gpu_measured.gpu --target h100 --save-hlo DIR`` compiled. A model over compile-time facts:
no timings; op names follow XLA's choice of a fusion's root, so compare parts summed over
both passes, not single rows.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax

from benchmarks import _common as C
from benchmarks.gpu_modeled import deviceless as D
from benchmarks.gpu_modeled import hlo_model as H
from benchmarks.models import train_steps as S

PARTS = ("attention", "layer norm", "linear", "optimizer", "other")


def part(op_name: str) -> str:
    """The part of the model a kernel's op name belongs to."""
    if "MultiheadAttention" in op_name:
        return "attention"
    if "LayerNorm" in op_name:
        return "layer norm"
    if "Linear" in op_name:
        return "linear"
    if re.search(r"jit\([^)]*\)/select_n$", op_name):  # the optimizer's finite-step select
        return "optimizer"
    return "other"


def kernel_groups(hlo: str, chip: H.Chip = H.H100_SXM) -> list[tuple[str, H.Kernel]]:
    """Every launched kernel's modeled cost (at ``chip`` 's rates) with its group,
    ``"<pass>: <part>[, GEMM][, recomputed]"``, read off the op name XLA gives the kernel."""
    entry, comps = H.parse(hlo)
    names = {}
    for ins, _ in H.kernels(entry, comps):
        m = re.search(r'op_name="([^"]*)"', ins.line)
        names[ins.name] = m.group(1) if m else ""
    out = []
    for k in H.kernel_costs(hlo, chip):
        op = names.get(k.name, "")
        key = ("backward" if "transpose(" in op else "forward") + ": " + part(op)
        key += ", GEMM" if k.flops else ""
        key += ", recomputed" if "rematted_computation" in op else ""
        out.append((key, k))
    return out


def breakdown(hlo: str) -> dict[str, dict[str, float]]:
    """``{"<pass>: <part>[, GEMM][, recomputed]": {"ms", "MiB", "kernels"}}`` of one step."""
    rows: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"ms": 0.0, "MiB": 0.0, "kernels": 0})
    for key, k in kernel_groups(hlo):
        r = rows[key]
        r["ms"] += k.time_s * k.runs * 1e3
        r["MiB"] += k.bytes * k.runs / 2**20
        r["kernels"] += k.runs
    return dict(rows)


def render(report: dict[str, Any]) -> str:
    systems = list(report["systems"])
    keys = sorted({k for s in systems for k in report["systems"][s]["parts"]})
    lines = [
        "## Where the modeled step time goes, by part of the model",
        "",
        f"Command: `{report['command']}`",
        "",
        C.metadata_markdown(report["meta"]),
        "",
        f"{report['description']}; GEMM mode {report['mode']}; `jax_softmax_custom_jvp` "
        f"{'as when compiled' if report['softmax_custom_jvp'] is None else report['softmax_custom_jvp']}. "
        "Modeled time (the roofline model of "
        "`benchmarks/gpu_modeled/hlo_model.py`: a model over the compiled program, not a measurement) and HBM "
        "traffic per group of kernels, grouped by the op name XLA gives each kernel.",
        "",
        "| system | modeled ms | HBM MiB | kernels | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for s in systems:
        t = report["systems"][s]
        lines.append(f"| {s} | {t['ms']:.3f} | {t['MiB']:,.0f} | {t['kernels']} | {t['peak_MiB']:,.0f} |")
    lines += ["", "| kernels | " + " | ".join(f"{s} ms · MiB · kernels" for s in systems) + " |"]
    lines.append("|---|" + "---|" * len(systems))
    for k in keys:
        cells = []
        for s in systems:
            r = report["systems"][s]["parts"].get(k)
            cells.append(f"{r['ms']:.3f} · {r['MiB']:,.0f} · {r['kernels']}" if r else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "Summed over both passes (GEMMs included, recomputation included):", ""]
    lines.append("| part | " + " | ".join(f"{s} ms" for s in systems) + " |")
    lines.append("|---|" + "---|" * len(systems))
    for p in PARTS:
        cells = [
            f"{sum(r['ms'] for k, r in report['systems'][s]['parts'].items() if k.split(': ')[1].startswith(p)):.3f}"
            for s in systems
        ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _saved_step(hlo_dir: Path, step: str, system: str) -> tuple[str, int, str | None]:
    """The optimised HLO, the peak bytes and the commit of a step ``benchmarks.gpu_measured.gpu --save-hlo``
    saved."""
    path = hlo_dir / f"{step}-{system}.hlo.gz"
    if not path.exists():
        raise SystemExit(
            f"--hlo-dir: no {path.name} in {hlo_dir} (run benchmarks.gpu_measured.gpu --target h100 --save-hlo)"
        )
    figures = json.loads(path.with_name(f"{step}-{system}.json").read_text())
    with gzip.open(path, "rt") as f:
        return f.read(), int(figures["memory"]["peak"]), figures.get("git_commit")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=["autocast-bf16", "mpx-bf16"], choices=S.SYSTEMS)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mode", choices=sorted(D.MODES), default="cublas")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS_DIR / "gpu_modeled")
    ap.add_argument("--label", default="", help="a name for the output files (kernel-breakdown-<label>-<date>)")
    ap.add_argument(
        "--hlo-dir",
        type=Path,
        help="read the steps `python -m benchmarks.gpu_measured.gpu --target h100 --save-hlo DIR` saved instead of "
        "compiling the small GPT: DIR/<step>-<system>.hlo.gz (and its .json, for the peak)",
    )
    ap.add_argument("--step", default="gpt2-small-x1-cublas", help="with --hlo-dir: <model>-x<batch>-<mode>")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "command": "python -m benchmarks.gpu_modeled.kernel_breakdown "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "meta": C.metadata(),
        "softmax_custom_jvp": bool(jax.config.jax_softmax_custom_jvp),
        "systems": {},
    }
    if args.hlo_dir is not None:
        saved = {s: _saved_step(args.hlo_dir, args.step, s) for s in args.systems}
        commits = ", ".join(sorted({str(c) for _, _, c in saved.values()}))
        report["description"] = (
            f"The benchmark step {args.step} as `python -m benchmarks.gpu_measured.gpu --target h100 --save-hlo` "
            f"saved it (commit {commits})"
        )
        report["mode"] = args.step.rsplit("-", 1)[-1]
        report["softmax_custom_jvp"] = None  # as when the steps were compiled (their report's meta)
        steps = {s: (hlo, peak) for s, (hlo, peak, _) in saved.items()}
    else:
        cfg = S.GPTConfig(vocab=args.vocab, seq=1024, width=768, depth=args.depth, heads=12)
        task = S._gpt_task("gpt", cfg, args.batch, shapes_only=True)
        report["description"], report["mode"] = task.description, args.mode
        sharding = D.target_sharding("h100")
        steps: dict[str, tuple[str, int]] = {}
        for system in args.systems:
            compiled = D.compile_step(task, system, args.mode, sharding)
            steps[system] = (compiled.as_text(), D.memory(compiled)["peak"])
    for system, (hlo, peak) in steps.items():
        parts = breakdown(hlo)
        report["systems"][system] = {
            "ms": sum(r["ms"] for r in parts.values()),
            "MiB": sum(r["MiB"] for r in parts.values()),
            "kernels": sum(r["kernels"] for r in parts.values()),
            "peak_MiB": peak / 2**20,
            "parts": parts,
        }
        print(f"{system}: {report['systems'][system]['ms']:.3f} ms modeled", flush=True)
    report["wall_time_s"] = time.perf_counter() - t0
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out = args.out_dir / "-".join(["kernel-breakdown", *([args.label] if args.label else []), date])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    C.write_json(out.with_suffix(".json"), report)
    out.with_suffix(".md").write_text(render(report))
    print(f"wrote {out}.md and .json")
    return report


if __name__ == "__main__":
    main()
