#!/usr/bin/env bash
# Quickstart command 1: set up ./.venv (idempotent) and train the demo ViT on the bundled
# handwritten digits in float32, float16 (amp + dynamic loss scaling) and bfloat16.
# Extra arguments go to the demo, e.g. `bash benchmarks/run_demo.sh --steps 100`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
ensure_venv demo
cd "$PROJECT_ROOT"
exec "$VENV_PYTHON" -m benchmarks.demo "$@"
