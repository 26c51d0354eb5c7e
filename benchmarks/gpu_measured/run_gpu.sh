#!/usr/bin/env bash
# The accelerator benchmark in one command (see docs/gpu-benchmark.md): training steps of
# ViT-Base, the MPX paper's ViT and a GPT-2-small-sized transformer in fp32, autocast
# bf16/f16/fp8 and the MPX recipe (skipped if `mpx` is not importable). Runs with the
# Python that has JAX (no virtualenv, no network: `PYTHON=... bash benchmarks/gpu_measured/run_gpu.sh`
# to pick one). Writes benchmarks/results/gpu_measured/gpu-<device>-<date>.{md,json}
# (--target: benchmarks/results/gpu_modeled/gpu-target-<target>-<date>.{md,json}). Extra arguments go to
# `python -m benchmarks.gpu_measured.gpu`: `--smoke` (tiny sizes, any backend), `--models gpt2-small`,
# `--systems fp32 autocast-fp8`, `--repeats 50`, `--out-dir DIR`.
# `--target h100`: no GPU needed; the steps compiled for an H100 (deviceless XLA:GPU, with
# the jax-cuda12 plugin and cuDNN that `bash tests/run_gpu_program.sh` installs into .cache/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " == *" --target "* ]]; then
  export JAX_PLATFORMS=cpu  # before JAX starts: the plugin registers without calling cuInit
  version="$("${PYTHON:-python3}" -c 'import jaxlib; print(jaxlib.__version__)')"
  if [ -d ".cache/jax-cuda-plugin-$version" ]; then
    export PYTHONPATH=".cache/jax-cuda-plugin-$version:$PYTHONPATH"
  fi
  # cuDNN (the lane installs it): without it amp's attention stays unfused (no cuDNN to trace)
  for cudnn in .cache/nvidia-cudnn-cu12-*/; do
    [ -f "$cudnn/.installed" ] && export PYTHONPATH="${cudnn%/}:$PYTHONPATH"
  done
fi
exec "${PYTHON:-python3}" -m benchmarks.gpu_measured.gpu "$@"
