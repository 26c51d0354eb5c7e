"""Measured GPU time per kernel of a train step, beside the roofline model's (a lent GPU).

``python -m benchmarks.gpu_measured.gpu ... --save-hlo DIR --kernel-times`` profiles one more step of each
system after timing it (``jax.profiler.trace``, the Perfetto/Chrome trace JAX writes) and
saves ``DIR/<step>-<system>.kernels.json``: the GPU time of every kernel name, per step.
:func:`compare` joins that with the step's HLO (``DIR/<step>-<system>.hlo.gz``): XLA names a
fusion's kernel after the fusion, so each measured kernel meets its modeled cost
(:func:`benchmarks.gpu_modeled.hlo_model.kernel_costs`), and both are grouped as
:func:`benchmarks.gpu_modeled.kernel_breakdown.breakdown` groups them (pass, part of the model, GEMM,
recomputed). Library kernels (cuBLAS, cuDNN) carry their library's names: they are summed
as ``library`` against the modeled custom calls. Where the model is wrong, this says where::

    python -m benchmarks.gpu_measured.kernel_times --device-kind "NVIDIA H200" DIR gpt2-small-x1-triton autocast-bf16 mpx-bf16
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_modeled import hlo_model as H
from benchmarks.gpu_modeled import kernel_breakdown as B


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The complete events (``ph == "X"``) of a Chrome-format trace on GPU devices (processes
    named ``/device:GPU:<i>``), as ``{"name", "ts", "dur", "tid"}`` in time order."""
    gpu_pids = {
        e["pid"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name" and "/device:GPU" in e.get("args", {}).get("name", "")
    }
    events = [
        {"name": e["name"], "ts": float(e.get("ts", 0.0)), "dur": float(e["dur"]), "tid": e.get("tid")}
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e
    ]
    return sorted(events, key=lambda e: e["ts"])


def gpu_kernel_times(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{kernel name: {"us": summed duration, "n": launches}}`` of a Chrome-format trace's
    events on GPU devices (:func:`gpu_events`)."""
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"us": 0.0, "n": 0})
    for e in gpu_events(trace):
        out[e["name"]]["us"] += e["dur"]
        out[e["name"]]["n"] += 1
    return dict(out)


def profile(
    run: Callable[[], Any], block: Callable[[Any], Any], steps: int = 2, events_path: Path | None = None
) -> dict[str, dict[str, float]]:
    """GPU time per kernel name of ``steps`` calls of ``run`` (each blocked), per step
    (empty where the trace has no GPU device, e.g. on CPU). With ``events_path``, the GPU
    events themselves (:func:`gpu_events`: order, start, stream) go there as gzipped JSON."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                block(run())
        paths = sorted(Path(tmp).rglob("*.trace.json.gz"))
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no *.trace.json.gz under {tmp}")
        with gzip.open(paths[-1], "rt") as f:
            trace = json.load(f)
    if events_path is not None:
        events_path.write_bytes(gzip.compress(json.dumps(gpu_events(trace)).encode()))
    times = gpu_kernel_times(trace)
    return {k: {"us": v["us"] / steps, "n": v["n"] / steps} for k, v in times.items()}


def _key(name: str) -> str:
    """A kernel's name as HLO and trace both spell it: XLA's ``.`` may be ``_`` in the trace."""
    return name.replace(".", "_")


def _take(left: dict[str, dict[str, float]], key: str) -> dict[str, float] | None:
    """The measured time of the kernel(s) named ``key``, removed from ``left``: the exact name,
    or names that only add a non-numeric suffix (``<fusion>_impl``: a kernel XLA emits for a
    fusion under a name of its own; ``_12`` would be another fusion)."""
    names = (
        [key] if key in left else [n for n in left if n.startswith(key + "_") and not n[len(key) + 1 :][:1].isdigit()]
    )
    if not names:
        return None
    taken = [left.pop(n) for n in names]
    return {"us": sum(t["us"] for t in taken), "n": sum(t["n"] for t in taken)}


def compare(hlo: str, measured: dict[str, dict[str, float]], chip: H.Chip = H.H100_SXM) -> dict[str, Any]:
    """Measured and modeled ms per kernel group of one step (see the module's docstring),
    modeled at ``chip`` 's rates.

    Returns ``{"groups": {group: {"measured_ms", "modeled_ms", "kernels"}}, "measured_ms",
    "modeled_ms", "unmatched": [(name, ms), ...]}``; GEMM custom calls and the library
    kernels no fusion name matches form the group ``library``."""
    left = {_key(k): v for k, v in measured.items()}
    groups: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: {"measured_ms": 0.0, "modeled_ms": 0.0, "kernels": 0}
    )
    for group, k in B.kernel_groups(hlo, chip):
        hit = _take(left, _key(k.name))
        if hit is None and k.op == "custom-call":
            group = "library"
        g = groups[group]
        g["modeled_ms"] += k.time_s * k.runs * 1e3
        g["measured_ms"] += (hit or {"us": 0.0})["us"] / 1e3
        g["kernels"] += k.runs
    unmatched = sorted(((n, v["us"] / 1e3) for n, v in left.items()), key=lambda t: -t[1])
    groups["library"]["measured_ms"] += sum(ms for _, ms in unmatched)
    return {
        "groups": dict(groups),
        "measured_ms": sum(g["measured_ms"] for g in groups.values()),
        "modeled_ms": sum(g["modeled_ms"] for g in groups.values()),
        "unmatched": unmatched[:40],
    }


def render(step: str, results: dict[str, dict[str, Any]], chip: str = "H100 SXM") -> str:
    """A markdown table: per group, each system's measured and modeled ms."""
    systems = list(results)
    groups = sorted({g for r in results.values() for g in r["groups"]})
    lines = [
        f"### {step}: measured GPU time per kernel group (modeled at the {chip}'s rates in brackets), ms per step",
        "",
        "| kernels | " + " | ".join(systems) + " |",
        "|---|" + "---|" * len(systems),
    ]
    for g in [*groups, "all"]:
        cells = []
        for s in systems:
            r = results[s] if g == "all" else results[s]["groups"].get(g)
            cells.append(f"{r['measured_ms']:.3f} ({r['modeled_ms']:.3f})" if r else "-")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """``[--device-kind KIND] DIR STEP SYSTEM [SYSTEM ...]``: the comparison table of those
    saved steps, modeled at the rates of the GPU that ``KIND`` names (``jax.Device.device_kind``,
    e.g. ``"NVIDIA H200"``; default the H100 SXM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chip = H.H100_SXM
    if argv[:1] == ["--device-kind"] and len(argv) > 1:
        chip, argv = H.chip_for(argv[1]), argv[2:]
    if len(argv) < 3:
        raise SystemExit(
            "usage: python -m benchmarks.gpu_measured.kernel_times [--device-kind KIND] DIR STEP SYSTEM [SYSTEM ...]"
        )
    hlo_dir, step, systems = Path(argv[0]), argv[1], argv[2:]
    results = {}
    for s in systems:
        base = hlo_dir / f"{step}-{s}"
        for suffix in (".hlo.gz", ".kernels.json"):
            if not base.with_name(base.name + suffix).exists():
                raise SystemExit(
                    f"{hlo_dir}: no {base.name + suffix} (benchmarks.gpu_measured.gpu --save-hlo DIR --kernel-times)"
                )
        hlo = gzip.decompress(base.with_name(base.name + ".hlo.gz").read_bytes()).decode()
        results[s] = compare(hlo, json.loads(base.with_name(base.name + ".kernels.json").read_text()), chip)
    md = render(step, results, chip.name)
    print(md)
    return md


if __name__ == "__main__":
    main()
