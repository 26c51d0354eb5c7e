# Shared by the Quickstart commands: create ./.venv once and install the project into it
# (editable) with the given extras; re-installs only when pyproject.toml changes.
# Usage: source .ci/venv.sh && ensure_venv demo
set -euo pipefail

ensure_venv() {
  local extras="$1"
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "jax-autocast needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
    return 1
  fi
  if [ ! -x "$root/.venv/bin/python" ]; then
    "$python" -m venv "$root/.venv"
    "$root/.venv/bin/python" -m pip install --quiet --upgrade pip
  fi
  local stamp="$root/.venv/.installed-$extras"
  local want
  want="$(cat "$root/pyproject.toml" | "$root/.venv/bin/python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$root/.venv/bin/python" -m pip install --quiet -e "$root[$extras]"
    echo "$want" > "$stamp"
  fi
  VENV_PYTHON="$root/.venv/bin/python"
  PROJECT_ROOT="$root"
}
