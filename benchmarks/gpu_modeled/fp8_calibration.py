"""Where ``autocast/_fp8_cost.py``'s quantisation constants come from, and what its check decides.

Reads the deviceless H100 compiles of ViT-Base's train step at batch x1, Triton mode, in
``benchmarks/results/gpu_modeled/gpu-target-h100-2026-11-26.json`` (amp bf16 and amp fp8 with every
matmul of at least 16 in float8, before the cost check existed), and lists those float8
matmuls with ``autocast.explain`` from the model's shapes. Per quantised element (the
operand, the weight and the cotangent of each float8 matmul, times how often it runs): the
non-GEMM HBM bytes the fp8 step moves beyond bf16's, and per float8 matmul the extra
kernels. Then, for every benchmark model, what the cost check decides (``target="h100"``).
CPU only, traces (nothing compiled or run), about a minute::

    python -m benchmarks.gpu_modeled.fp8_calibration   # writes benchmarks/results/gpu_modeled/fp8_calibration.{md,json}
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import autocast
from autocast import _fp8_cost
from benchmarks import _common as C
from benchmarks.models import train_steps as S

ROOT = Path(__file__).resolve().parents[2]
SOURCE = C.RESULTS_DIR / "gpu_modeled" / "gpu-target-h100-2026-11-26.json"


def _explain(model: str, target: str | None) -> autocast.Explanation:
    task = S.MODELS[model](shapes_only=True)
    policy = autocast.extend_policy(
        {jax.lax.dot_general_p: autocast.use_float8(target=target)}, base=autocast.load_policy("fp8")
    )
    params, static = eqx.partition(task.model, S.is_leaf_array)

    def loss(p, batch):
        return task.loss(eqx.combine(p, static), batch)

    return autocast.explain(loss, compute_dtype=jnp.bfloat16, amp_policy=policy)(params, task.batch)


def _elements(m: Any) -> int:
    """Elements of x, w and the cotangent of one float8 matmul (``Float8Matmul``; its GEMM
    sizes from its reason, "GEMM M=.. N=.. K=.. [xB]"), times its count."""
    found = re.search(r"M=(\d+) N=(\d+) K=(\d+)(?: x(\d+))?", m.reason)
    assert found, m.reason
    mm, n, k = (int(found[i]) for i in (1, 2, 3))
    b = int(found[4] or 1)
    return m.count * b * (mm * k + k * n + mm * n)


def main(argv: list[str] | None = None) -> dict:
    # no options: --help says what it reads and writes
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    runs = json.loads(SOURCE.read_text())["models"]["vit-base"]["runs"]["x1-triton"]["results"]
    bf16, fp8 = runs["autocast-bf16"]["roofline"], runs["autocast-fp8"]["roofline"]
    report = _explain("vit-base", None)
    matmuls = sum(m.count for m in report.float8_matmuls)
    elements = sum(_elements(m) for m in report.float8_matmuls)
    extra_bytes = fp8["other_bytes"] - bf16["other_bytes"]
    extra_kernels = fp8["kernels"] - bf16["kernels"]
    calibration = {
        "float8_matmuls": matmuls,
        "compiled_float8_gemms": runs["autocast-fp8"]["fp8_gemms"],
        "quantised_elements": elements,
        "extra_non_gemm_bytes": extra_bytes,
        "bytes_per_element": extra_bytes / elements,
        "in_bf16_units": extra_bytes / elements / 2,
        "extra_kernels_per_matmul": extra_kernels / matmuls,
        "model_constants": {
            "QUANT_BYTES_PER_ELEMENT": _fp8_cost.QUANT_BYTES_PER_ELEMENT,
            "QUANT_LAUNCHES": _fp8_cost.QUANT_LAUNCHES,
        },
    }
    decisions = {}
    for model in S.TARGET_MODELS:
        r = _explain(model, "h100")
        decisions[model] = {
            "float8": sum(m.count for m in r.float8_matmuls),
            "declined": sum(m.count for m in r.float8_declined),
            "rows": [
                {"shape": [list(s) for s in m.shape], "count": m.count, "float8": ok, "reason": m.reason}
                for ok, ms in ((True, r.float8_matmuls), (False, r.float8_declined))
                for m in ms
            ],
        }
    out = {"meta": C.metadata(), "source": str(SOURCE.relative_to(ROOT)), "calibration": calibration}
    out["decisions_h100"] = decisions
    (C.results_dir("gpu_modeled") / "fp8_calibration.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# float8 cost check: calibration and decisions (H100)",
        "",
        f"`python -m benchmarks.gpu_modeled.fp8_calibration`, {out['meta'].get('date', '')}; source: `{out['source']}`",
        "(ViT-Base, batch 64, Triton mode; amp fp8 with every matmul of at least 16 in float8).",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| float8 matmuls (explain) / fp8 GEMMs (compiled) | {matmuls} / {calibration['compiled_float8_gemms']} |",
        f"| quantised elements (x, w, cotangent) | {elements:,} |",
        f"| non-GEMM bytes, fp8 over bf16 | {extra_bytes:,} |",
        f"| per quantised element | {calibration['bytes_per_element']:.2f} B "
        f"({calibration['in_bf16_units']:.2f} x bf16's size; model: {_fp8_cost.QUANT_BYTES_PER_ELEMENT}) |",
        f"| extra kernels per float8 matmul | {calibration['extra_kernels_per_matmul']:.2f} "
        f"(model: {_fp8_cost.QUANT_LAUNCHES}) |",
        "",
        "## What the check decides (target h100)",
        "",
        "| model | matmuls in float8 | left in bf16 |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {d['float8']} | {d['declined']} |" for m, d in decisions.items()]
    for m, d in decisions.items():
        lines += ["", f"### {m}", ""]
        seen = set()
        for row in d["rows"]:
            key = (tuple(map(tuple, row["shape"])), row["float8"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {' x '.join(map(str, row['shape']))}: {row['reason']}")
    (C.results_dir("gpu_modeled") / "fp8_calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:16]))
    return out


if __name__ == "__main__":
    main()
