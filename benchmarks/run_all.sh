#!/usr/bin/env bash
# The CPU benchmarks of 2026-11-23 in one go (about 30 min on a 2-core CPU), each writing to
# benchmarks/results/<question>/. The other results (the demo's seed studies, the character GPT,
# optimizer memory, the GPU and corpus runs) have their own commands: benchmarks/README.md.
# Run from the repo root, in an environment with `pip install -e ".[demo,test]"` (the
# test extra brings the comparison packages: mixed-precision-for-jax, jmp, jaxamp).
set -euo pipefail
PY=${PYTHON:-python}
$PY -m benchmarks.accuracy.demo
$PY -m benchmarks.comparison.bench_vit --quick
$PY -m benchmarks.comparison.bench_vit --shape desktop --sizes 8 16 32 64 --repeats 5 --warmup 1
$PY -m benchmarks.comparison.bench_vit --shape base --sizes 1 2 --repeats 3 --warmup 1
$PY -m benchmarks.overhead.bench_overhead
$PY -m benchmarks.memory.bench_mlp_residuals
$PY -m benchmarks.gradients.bench_custom_derivatives
$PY -m benchmarks.gradients.bench_bias_grad
$PY -m benchmarks.memory.bench_lstm_scan
$PY -m benchmarks.overhead.explain_vit --batch 8
# head-to-head at one batch size with more rounds, plus the fp32 recompute control
$PY -m benchmarks.comparison.bench_vit --shape desktop --sizes 16 --repeats 15 --warmup 2 \
    --systems fp32 fp32-remat autocast-f16 autocast-f16-noremat mpx-f16 autocast-bf16 mpx-bf16 \
    --out vit_desktop_headtohead
$PY -m benchmarks.distributed.bench_distributed
