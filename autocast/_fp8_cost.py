"""Whether a float8 matmul pays: a roofline of one `dot_general`'s training step on a GPU.

A matmul `x @ w` of GEMM sizes M, N, K costs three GEMMs of `2·M·N·K` FLOPs in a train
step (the forward product and the two gradient products). Each GEMM takes
`max(HBM bytes / bandwidth, FLOPs / dense peak) + launch`, reading its operands and
writing its result in the compute dtype (float8 operands: one byte). In float8 the GEMMs run
at the float8 peak but the three tensors they read (`x`, `w` and the cotangent) are
quantised first, each of its elements costing `QUANT_BYTES_PER_ELEMENT` times the compute
dtype's size in HBM traffic (the amax reduction's read, the quantising kernel's read and
float8 writes of the two layouts the GEMMs read) and `QUANT_LAUNCHES` more kernels per
matmul. A matmul runs in float8 only where that is modeled at least 5 % faster (`MARGIN`).

The constants are calibrated on the programs XLA:GPU compiles for the benchmark models' train
steps (`benchmarks/results/archive/gpu_modeled/gpu-target-h100-fp8-filter-2026-11-26.md`; the average overhead
of the all-float8 ViT-Base step, 3.4 bytes per quantised element and 8.3 kernels per matmul,
is in `benchmarks/results/gpu_modeled/fp8_calibration.md`): a lone float8 matmul costs more
than that average, and at 2 compute-dtype sizes per element the check put ViT-Base's and
GPT-2 small's MLP matmuls in float8, whose steps were then 3-5 % slower than bfloat16's;
at 3.2, with a 5 % margin, no benchmark step is slower than bfloat16's. Like torchao's
float8 auto-filter for PyTorch, it keeps small and memory-bound GEMMs out of float8; unlike
a size threshold it weighs the three sizes together, so a thin but long GEMM (a language
model's head) can still pay.

A model, not a measurement: no caches, no overlap, datasheet peaks. The rates per GPU are
in `TARGETS`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU's datasheet rates: HBM bandwidth (bytes/s), dense tensor-core peaks
    (FLOP/s) for 16-bit floats and float8, and a kernel's launch cost (s)."""

    name: str
    hbm_bytes_per_s: float
    half_flops: float
    fp8_flops: float
    launch_s: float = 2e-6


TARGETS = {
    # H100 SXM5 (HBM3): 3.35 TB/s; dense 989 TFLOP/s bf16/f16, 1979 float8
    "h100": Target("H100 SXM", 3.35e12, 989e12, 1979e12),
    # H200 SXM (HBM3e): the H100's tensor cores, 4.8 TB/s
    "h200": Target("H200 SXM", 4.8e12, 989e12, 1979e12),
    # B200 (HBM3e): 8 TB/s; dense 2.25 PFLOP/s bf16/f16, 4.5 float8
    "b200": Target("B200", 8.0e12, 2250e12, 4500e12),
}
"""The GPUs `autocast.use_float8` can decide for (its `target`)."""

QUANT_BYTES_PER_ELEMENT = 3.2
"""HBM traffic per quantised element, in units of the compute dtype's size (see above)."""
QUANT_LAUNCHES = 9
"""Kernels a float8 matmul adds to the train step (the all-float8 ViT-Base step: 8.3)."""
MARGIN = 0.95
"""float8 must be modeled at least 5 % faster: within that, the model cannot tell (GPT-2
small's LM head at batch 8: modeled 0.96 of bfloat16's time, compiled 0.7 % slower)."""


def _gemm_s(t: Target, m: int, n: int, k: int, b: int, operand_bytes: int, out_bytes: int, flops_per_s: float) -> float:
    """The three GEMMs of a train step (y = x w, dx = g wT, dw = xT g), each reading two of
    (x: MxK, w: KxN, g: MxN) and writing the third; `b` batch dimensions' product."""
    x, w, g = b * m * k, b * k * n, b * m * n
    flops = 2 * b * m * n * k
    total = 0.0
    for reads, writes in ((x + w, g), (g + w, x), (x + g, w)):
        total += max((reads * operand_bytes + writes * out_bytes) / t.hbm_bytes_per_s, flops / flops_per_s)
        total += t.launch_s
    return total


def step_times(target: Target, m: int, n: int, k: int, b: int = 1, half_bytes: int = 2) -> tuple[float, float]:
    """Modeled seconds of one matmul's train-step GEMMs `(compute dtype, float8)`, the
    float8 figure with its quantisation; `b`: the product of the batch dimensions."""
    half = _gemm_s(target, m, n, k, b, half_bytes, half_bytes, target.half_flops)
    fp8 = _gemm_s(target, m, n, k, b, 1, half_bytes, target.fp8_flops)
    quant = QUANT_BYTES_PER_ELEMENT * half_bytes * b * (m * k + k * n + m * n) / target.hbm_bytes_per_s
    return half, fp8 + quant + QUANT_LAUNCHES * target.launch_s


def pays(target: Target, m: int, n: int, k: int, b: int = 1, half_bytes: int = 2) -> tuple[bool, str]:
    """Whether float8 is modeled at least `MARGIN` faster for a GEMM of sizes M, N, K
    (`b` of them), and the verdict with the modeled times (for `explain`)."""
    half, fp8 = step_times(target, m, n, k, b, half_bytes)
    ok = fp8 < MARGIN * half
    verdict = "faster" if ok else f"under {1 - MARGIN:.0%} faster" if fp8 < half else "slower"
    times = f"{target.name}: {fp8 * 1e6:.1f} us in float8, {half * 1e6:.1f} us in the compute dtype"
    return ok, f"modeled {verdict} in float8 ({times})"
