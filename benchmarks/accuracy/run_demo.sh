#!/usr/bin/env bash
# Quickstart command 1: set up ./.venv with the `demo` extra (idempotent) and run the demo:
# a small ViT trained on scikit-learn's digits in fp32, amp float16 (+ dynamic loss
# scaler), amp bfloat16 and amp float8 matmuls (the "fp8" policy), seed 0 (about 5 minutes
# on 2 cores). Extra arguments go to the demo, e.g. `--seeds 0 1 2` (the three-seed
# accuracy check) or `--steps 300`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../.ci/venv.sh"
# The newest Python here gets the newest JAX (0.11+ needs Python >= 3.12); else python3.
py="${PYTHON:-$(find_python 3.13 || find_python 3.12 || echo python3)}"
ensure_venv .venv "$py" demo
cd "$PROJECT_ROOT"
exec "$VENV_PYTHON" -m benchmarks.accuracy.demo "$@"
