#!/usr/bin/env bash
# The GPU-program lane: compile amp train steps for an NVIDIA H100 on this CPU-only machine
# (deviceless XLA:GPU, see tests/test_gpu_program.py) and check what XLA:GPU makes of them.
# Installs the jax-cuda12 plugin wheels matching the newest venv's jaxlib (about 200 MB, no
# nvidia-* wheels, no GPU needed) once into .cache/jax-cuda-plugin-<version>/ (pip's cache
# makes a re-download cheap), then runs the test files with it on PYTHONPATH (test_gpu_program.py:
# the train steps' census, memory and roofline guard; test_gpu_roofline.py: the roofline model on
# programs with hand-counted bytes and FLOPs).
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
# JAX_PLATFORMS=cpu before JAX starts: the plugin then registers without calling cuInit.
cd "$PROJECT_ROOT"
JAX_PLATFORMS=cpu PYTHONPATH="$plugin${PYTHONPATH:+:$PYTHONPATH}" \
  "$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 --dist loadgroup -q tests/test_gpu_program.py tests/test_gpu_roofline.py "$@"
