#!/usr/bin/env bash
# Quickstart command 2: run the whole test suite on CPU in two environments, each in its own
# virtualenv (created once, re-installed only when pyproject.toml changes):
#   newest: Python 3.13 with the newest JAX, Flax, Equinox and optax the index serves
#   oldest: Python 3.11 with the oldest supported JAX (0.9.2)
# Exits non-zero if either fails. One environment only: AUTOCAST_ENVS=newest (or oldest).
# Extra arguments go to pytest, e.g. `bash tests/run_tests.sh -k policy`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
OLDEST_JAX="0.9.2"  # keep in step with pyproject.toml's jax lower bound
envs="${AUTOCAST_ENVS:-newest oldest}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
status=0
summary=()
for env in $envs; do
  case "$env" in
    newest)
      if ! py="$(find_python 3.13)"; then
        if [ "${CI:-}" = "true" ]; then
          echo "newest: Python 3.13 not found (install it, e.g. with pyenv)" >&2
          exit 1
        fi
        py="${PYTHON:-python3}"
        echo "newest: Python 3.13 not found; using $py with the newest JAX it can install" >&2
      fi
      ensure_venv .venv-newest "$py" test --upgrade "jax[cpu]" ;;
    oldest)
      py="$(find_python 3.11 || echo "${PYTHON:-python3}")"
      ensure_venv .venv-oldest "$py" test "jax[cpu]==$OLDEST_JAX" "jaxlib==$OLDEST_JAX" ;;
    *)
      echo "unknown environment '$env' in AUTOCAST_ENVS (allowed: newest, oldest)" >&2
      exit 2 ;;
  esac
  versions="$("$VENV_PYTHON" -c 'import sys, jax, flax, equinox, optax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, equinox {equinox.__version__}, optax {optax.__version__}")')"
  echo "=== $env: $versions"
  start=$SECONDS
  if (cd "$PROJECT_ROOT" && "$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 -q "$@"); then
    summary+=("$env ($versions): passed in $((SECONDS - start)) s")
  else
    status=1
    summary+=("$env ($versions): FAILED after $((SECONDS - start)) s")
  fi
done
printf '%s\n' "${summary[@]}"
exit $status
