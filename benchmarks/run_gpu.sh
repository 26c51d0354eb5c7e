#!/usr/bin/env bash
# The accelerator benchmark in one command (see docs/gpu-benchmark.md): training steps of
# ViT-Base, the MPX paper's ViT and a GPT-2-small-sized transformer in fp32, autocast
# bf16/f16/fp8 and the MPX recipe (skipped if `mpx` is not importable). Runs with the
# Python that has JAX (no virtualenv, no network: `PYTHON=... bash benchmarks/run_gpu.sh`
# to pick one). Writes benchmarks/results/gpu-<device>-<date>.{md,json}. Extra arguments go to
# `python -m benchmarks.gpu`: `--smoke` (tiny sizes, any backend), `--models gpt2-small`,
# `--systems fp32 autocast-fp8`, `--repeats 50`, `--out-dir DIR`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu "$@"
