#!/usr/bin/env bash
# Builds the documentation site into site/ (strict: a broken link, a missing page or a
# docstring that does not match its signature fails the build). Offline: no inventories are
# downloaded. Creates .venv-docs (the `docs` extra) the first time and reuses it after that.
# Usage: bash docs/build.sh            (then open site/index.html)
#        bash docs/build.sh serve      (live preview on http://127.0.0.1:8000)
set -euo pipefail
export NO_MKDOCS_2_WARNING=1
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
py="$(find_python 3.13 || find_python 3.12 || find_python 3.11 || echo "${PYTHON:-python3}")"
ensure_venv .venv-docs "$py" docs
cd "$PROJECT_ROOT"
# The benchmark results (tables and figures) are reachable from the site as docs/results/.
rm -rf docs/results
mkdir -p docs/results
# (tables and figures, in their question folders; archive/ included: the docs link superseded runs too)
(cd benchmarks/results && find . -name '*.md' -o -name '*.png') | while IFS= read -r f; do
  mkdir -p "docs/results/$(dirname "$f")"
  cp "benchmarks/results/$f" "docs/results/$f"
done
if [ "${1:-}" = "serve" ]; then
  exec "$VENV_PYTHON" -m mkdocs serve -a 127.0.0.1:8000
fi
"$VENV_PYTHON" -m mkdocs build --strict --clean
echo "site built: $PROJECT_ROOT/site/index.html"
