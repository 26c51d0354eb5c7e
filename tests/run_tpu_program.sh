#!/usr/bin/env bash
# The TPU-program lane: compile train steps for a TPU v5e on this CPU-only machine (deviceless
# XLA:TPU through libtpu's topology API, see tests/test_tpu_program.py and
# benchmarks/tpu_modeled/) and check what XLA:TPU makes of them: the 2 % guard on temp memory
# and bytes accessed of the committed figures, the matmul operand-dtype census.
# Makes the Python 3.13 virtualenv .venv-tpu once (the `test` extra, the project editable, and
# jax[tpu] at the newest venv's JAX: libtpu, about 640 MB installed; JAX 0.12's libtpu wheels
# need Python >= 3.13); uv's (or pip's) wheel cache makes a re-install cheap, as for the GPU
# lane's cuDNN wheel. ensure_venv re-installs only when pyproject.toml or the pins change.
# AUTOCAST_TPU_JAX picks another JAX (default below). AUTOCAST_TPU_SETUP_ONLY=1: the virtualenv
# only. Extra arguments go to pytest.
# JAX_PLATFORMS=cpu: JAX starts on the CPU and compiles for the TPU topology only;
# ALLOW_MULTIPLE_LIBTPU_LOAD=1: libtpu otherwise takes /tmp/libtpu_lockfile and a second process
# that loads it (another lane, a benchmark run beside the tests) fails with ABORTED.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
py="$(find_python 3.13)" || {
  echo "the TPU lane needs Python 3.13 (libtpu's wheels for JAX 0.12)" >&2
  exit 1
}
jax_version="${AUTOCAST_TPU_JAX:-0.12.0.1}"
ensure_venv .venv-tpu "$py" test "jax[tpu]==$jax_version"
[ "${AUTOCAST_TPU_SETUP_ONLY:-0}" = 1 ] && exit 0
cd "$PROJECT_ROOT"
export JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 AUTOCAST_TPU_LANE=1
# libtpu prints errors about TPU worker hostnames and the accelerator type when it loads (before
# its log-level settings are read): harmless for compiling
# two workers (--dist loadscope): the tests of one train step are one class, run on one worker, so
# that each step compiles once, two at a time (xdist_group marks with --dist loadgroup did not
# group them under pytest 9.2 and xdist 3.8)
"$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 --dist loadscope -q tests/test_tpu_program.py "$@"
