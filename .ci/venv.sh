# Shared by the Quickstart commands: create a virtualenv once and install the project into
# it (editable) with the given extras and pins; re-installs only when pyproject.toml or the
# pins change.
# Usage: source .ci/venv.sh && ensure_venv .venv python3 demo [pip specs...]
set -euo pipefail

# fast_cpu_compiles: the test lanes compile thousands of small CPU programs and run each once
# or twice, so their time is mostly XLA's. LLVM's optimisation of the generated code costs
# more than it saves (the lanes take about a fifth less time at level 0; XLA's HLO passes,
# fusion and layout, what amp's tests look at, do not depend on it; AUTOCAST_XLA_OPT=default
# keeps XLA's own level). And JAX's persistent compilation cache (.cache/jax-compilation,
# every compile, keyed by program, options and jaxlib version): a later lane or run on the same
# jaxlib (nextjax after newest, a local re-run) loads what an earlier one compiled.
# AUTOCAST_JAX_CACHE=0 turns the cache off.
fast_cpu_compiles() {
  if [ "${AUTOCAST_XLA_OPT:-0}" != default ] && [[ "${XLA_FLAGS:-}" != *xla_backend_optimization_level* ]]; then
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=${AUTOCAST_XLA_OPT:-0}"
  fi
  if [ "${AUTOCAST_JAX_CACHE:-1}" != 0 ]; then
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$root/.cache/jax-compilation}"
    export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
    export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:-0}"
  fi
}

# find_python 3.13: an interpreter of that version: pythonX.Y on PATH, else pyenv's build.
find_python() {
  local v="$1" c full
  for c in "python$v" "python3"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))" 2>/dev/null; then
      command -v "$c"
      return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    full="$(pyenv versions --bare 2>/dev/null | grep -E "^${v//./\\.}\.[0-9]+$" | sort -V | tail -n 1 || true)"
    if [ -n "$full" ] && [ -x "$(pyenv root)/versions/$full/bin/python$v" ]; then
      echo "$(pyenv root)/versions/$full/bin/python$v"
      return 0
    fi
  fi
  return 1
}

# find_uv ROOT: the uv executable: from PATH, else installed once with pip into ROOT/.venv-uv.
# uv resolves and downloads in parallel: the corpus virtualenv (about 150 packages) takes
# about a minute from an empty cache where pip, one request at a time through a slow
# index, took over 20 minutes. Fails (and pip does the work) if uv cannot be installed;
# AUTOCAST_NO_UV=1 forces pip.
find_uv() {
  local root="$1" py
  [ "${AUTOCAST_NO_UV:-}" = 1 ] && return 1
  if command -v uv >/dev/null 2>&1; then
    command -v uv
    return 0
  fi
  if [ ! -x "$root/.venv-uv/bin/uv" ]; then
    py="$(find_python 3.13 || find_python 3.12 || find_python 3.11 || command -v python3)" || return 1
    if ! { "$py" -m venv "$root/.venv-uv" && "$root/.venv-uv/bin/python" -m pip install --quiet "uv>=0.5,<1"; } >&2; then
      rm -rf "$root/.venv-uv"
      echo "uv could not be installed: pip makes the virtualenvs" >&2
      return 1
    fi
  fi
  echo "$root/.venv-uv/bin/uv"
}

# ensure_venv DIR PYTHON EXTRAS [PIP_SPECS...]: sets VENV_PYTHON and PROJECT_ROOT.
# With uv (find_uv) the virtualenv is seeded with pip too, for what calls `python -m pip`.
ensure_venv() {
  local dir="$1" python="$2" extras="$3"
  shift 3
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "jax-autocast needs Python >= 3.11 (got '$python'; set PYTHON=/path/to/python3.11)" >&2
    return 1
  fi
  local venv="$root/$dir" uv
  uv="$(find_uv "$root")" || uv=""
  if [ ! -x "$venv/bin/python" ]; then
    if [ -n "$uv" ]; then
      "$uv" venv --quiet --seed --python "$python" "$venv"
    else
      "$python" -m venv "$venv"
      "$venv/bin/python" -m pip install --quiet --upgrade pip
    fi
  fi
  local stamp="$venv/.installed-$extras"
  local want
  want="$( (cat "$root/pyproject.toml"; echo "$*") | "$venv/bin/python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    if [ -n "$uv" ]; then
      "$uv" pip install --quiet --python "$venv/bin/python" -e "$root[$extras]" "$@"
    else
      "$venv/bin/python" -m pip install --quiet -e "$root[$extras]" "$@"
    fi
    echo "$want" > "$stamp"
  fi
  VENV_PYTHON="$venv/bin/python"
  PROJECT_ROOT="$root"
}
