"""The census of the GPU-program lane's train steps on the H100 target, as a table.

``JAX_PLATFORMS=cpu PYTHONPATH=<jax-cuda12 plugin> python -m benchmarks.gpu_modeled.gpu_program_census``
compiles the steps of ``tests/test_gpu_program.py`` (Equinox MLP, ViT, transformer block; also
``gpt``; fp32, bf16, f16, fp8, and ``bf16-xla``: attention as written; Triton and cuBLAS
modes) without a GPU (with the cuDNN wheel on ``PYTHONPATH`` too, for fused attention) and writes
``benchmarks/results/gpu_modeled/gpu-program-census-<label>-<date>.md``: kernels, GEMM launches, GEMMs by
operand and result dtype, float32 x float32 GEMMs outside ``amp_stop``, transposes around
GEMMs, cuDNN fused attention calls, temp and peak memory, HBM bytes and modeled time (the roofline model of
``benchmarks/gpu_modeled/hlo_model.py``). ``--autocast-from DIR`` imports ``autocast`` from ``DIR`` (an
older checkout, for a before/after comparison). Compile-time facts: no timings.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "vit", "block"])
    ap.add_argument("--systems", nargs="+", default=["fp32", "bf16", "f16", "fp8"])
    ap.add_argument("--autocast-from", default=None, help="import autocast from this directory")
    ap.add_argument("--label", default="current")
    args = ap.parse_args(argv)
    if args.autocast_from:
        sys.path.insert(0, str(Path(args.autocast_from).resolve()))
    import jax

    import autocast
    from tests import test_gpu_program as G

    rows = [
        "| model | system | mode | kernels | GEMM launches | GEMMs (operands -> result) | f32 x f32 outside amp_stop "
        "| transposes into / after GEMMs | cuDNN attention (fwd / bwd) | temp MiB | peak MiB | HBM MiB | modeled µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    t0 = time.perf_counter()
    for model in args.models:
        for system in args.systems:
            for mode in ("triton", "cublas"):
                r = G._compiled(model, system, mode)
                gemms = ", ".join(f"{v} {k}" for k, v in sorted(r["gemm_types"].items(), key=lambda kv: -kv[1]))
                m = r["memory"]
                rows.append(
                    f"| {model} | {system} | {mode} | {r['kernels']} | {r['gemm_kernels']} | {gemms} | {r['f32_gemms']} "
                    f"| {r['transposes_into_gemms']} / {r['transposes_after_gemms']} "
                    f"| {r['fmha_forward']} / {r['fmha_backward']} | {m['temp'] / 2**20:.2f} "
                    f"| {m['peak'] / 2**20:.2f} | {r['roofline']['hbm_bytes'] / 2**20:.1f} "
                    f"| {r['roofline']['time_s'] * 1e6:.1f} |"
                )
                print(rows[-1], flush=True)
    wall = time.perf_counter() - t0
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    cmd = "JAX_PLATFORMS=cpu PYTHONPATH=<plugin> python -m benchmarks.gpu_modeled.gpu_program_census " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    md = (
        f"## GPU-program lane census ({args.label}), H100 target, deviceless\n\n"
        f"Command: `{cmd}`\n\n- date: {date}\n- machine: {platform.node()} ({platform.machine()}, CPU only)\n"
        f"- jax {jax.__version__}, autocast from `{Path(autocast.__file__).parent}`\n- wall time: {wall:.0f} s\n\n"
        "Steps of `tests/test_gpu_program.py` (value_and_grad + SGD, parameters donated). No timings, no "
        "autotuning; compare within one mode. HBM MiB and modeled µs: the roofline model (a model, not a "
        "measurement). Definitions: docs/gpu-benchmark.md.\n\n" + "\n".join(rows) + "\n"
    )
    out = Path(__file__).resolve().parents[1] / "results" / "gpu_modeled" / f"gpu-program-census-{args.label}-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
