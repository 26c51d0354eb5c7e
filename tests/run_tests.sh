#!/usr/bin/env bash
# Quickstart command 2: set up ./.venv (idempotent) and run the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash tests/run_tests.sh -k policy`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
ensure_venv test
cd "$PROJECT_ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 -q "$@"
