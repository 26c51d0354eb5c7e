#!/usr/bin/env bash
# Run the test suite against each JAX release of the supported range (pyproject.toml:
# jax>=0.9.2,<0.11), each in its own virtualenv .venv-jax-<version>.
# Usage: bash .ci/jax_versions.sh [versions...]   (default: the oldest and newest supported)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.9.2 0.10.2)
python="${PYTHON:-python3}"
status=0
for v in "${versions[@]}"; do
  venv=".venv-jax-$v"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
  fi
  "$venv/bin/python" -m pip install --quiet "jax[cpu]==$v" -e ".[test]"
  echo "=== jax $v: $("$venv/bin/python" -c 'import jax, equinox, optax, flax; print("jax", jax.__version__, "equinox", equinox.__version__, "optax", optax.__version__, "flax", flax.__version__)')"
  JAX_PLATFORMS=cpu "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 -q "tests" || status=1
done
exit $status
