#!/usr/bin/env bash
# The GPU-program lane: compile amp train steps for an NVIDIA H100 on this CPU-only machine
# (deviceless XLA:GPU, see tests/test_gpu_program.py) and check what XLA:GPU makes of them.
# Installs the jax-cuda12 plugin wheels matching the newest venv's jaxlib (about 200 MB, no GPU
# needed) once into .cache/jax-cuda-plugin-<version>/, and cuDNN (nvidia-cudnn-cu12, a 766 MB
# download, 1.2 GB installed: JAX checks cuDNN's version when it traces the cuDNN attention call
# amp fuses attention into, docs/attention.md) once into .cache/nvidia-cudnn-cu12-<version>/
# (pip's cache makes a re-download cheap), then runs the test files with both on PYTHONPATH
# (test_gpu_program.py: the train steps' census, fused attention, memory and roofline guard;
# test_gpu_roofline.py: the roofline model on programs with hand-counted bytes and FLOPs).
# AUTOCAST_CUDNN_VERSION picks another cuDNN wheel (default below).
# Two pytest workers (--dist loadgroup): the tests that read one model and GEMM mode share
# its compiles (cached per process) on one worker. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
py="$(find_python 3.13 || echo "${PYTHON:-python3}")"
ensure_venv .venv-newest "$py" test,checkpoint --upgrade "jax[cpu]"
version="$("$VENV_PYTHON" -c 'import jaxlib; print(jaxlib.__version__)')"
plugin="$PROJECT_ROOT/.cache/jax-cuda-plugin-$version"
if [ ! -f "$plugin/.installed" ]; then
  rm -rf "$plugin"
  "$VENV_PYTHON" -m pip install --quiet --no-deps --target "$plugin" \
    "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version"
  touch "$plugin/.installed"
fi
cudnn_version="${AUTOCAST_CUDNN_VERSION:-9.27.0.42}"
cudnn="$PROJECT_ROOT/.cache/nvidia-cudnn-cu12-$cudnn_version"
if [ ! -f "$cudnn/.installed" ]; then
  rm -rf "$cudnn"
  "$VENV_PYTHON" -m pip install --quiet --no-deps --target "$cudnn" "nvidia-cudnn-cu12==$cudnn_version"
  touch "$cudnn/.installed"
fi
# JAX_PLATFORMS=cpu before JAX starts: the plugin then registers without calling cuInit (and
# loads libcudnn from the nvidia.cudnn package on the path).
cd "$PROJECT_ROOT"
JAX_PLATFORMS=cpu PYTHONPATH="$plugin:$cudnn${PYTHONPATH:+:$PYTHONPATH}" \
  "$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 --dist loadgroup -q tests/test_gpu_program.py tests/test_gpu_roofline.py "$@"
