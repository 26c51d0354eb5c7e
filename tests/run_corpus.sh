#!/usr/bin/env bash
# The real-model corpus lane: third-party models, unedited, from their published packages
# (pinned in pyproject.toml's `corpus` and `corpus-recurrentgemma` extras; Equinox and Flax
# come with `test`), run under `autocast.amp` in float16 and bfloat16 against float32
# (tests/real_models/, docs/real-models.md). Two virtualenvs, created once and re-installed
# only when pyproject.toml changes, with uv (.ci/venv.sh: about a minute from an empty cache,
# uv's cache makes it seconds after that):
#   .venv-corpus     gemma, keras-hub (installed --no-deps: see pyproject.toml), diffrax,
#                    haiku, jraph, equimo, numpyro, jax-md, penzai, diffusers (and Equinox, Flax)
#   .venv-corpus-rg  recurrentgemma: it pins typeguard<3, gemma 4.0.1's kauldron needs
#                    typeguard>=4.4.1, and recurrentgemma's jaxtyping annotations do not
#                    import under typeguard 4, so the two cannot share an environment.
# A package that fails to import fails its tests (nothing is skipped).
# Extra arguments go to pytest, e.g. `bash tests/run_corpus.sh -k gemma`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
if ! py="$(find_python 3.13)"; then
  if [ "${CI:-}" = "true" ]; then
    echo "corpus: Python 3.13 not found (install it, e.g. with pyenv)" >&2
    exit 1
  fi
  py="${PYTHON:-python3}"
  echo "corpus: Python 3.13 not found; using $py" >&2
fi
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" KERAS_BACKEND=jax AUTOCAST_CORPUS=1
fast_cpu_compiles
RG_FILE=tests/real_models/test_recurrentgemma.py
status=0
ensure_venv .venv-corpus-rg "$py" test,corpus-recurrentgemma
rg_python="$VENV_PYTHON"
ensure_venv .venv-corpus "$py" test,corpus
# keras-hub without its tensorflow-text dependency (pyproject.toml's `corpus` note)
KERAS_HUB=0.32.0
if ! "$VENV_PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('keras-hub') != '$KERAS_HUB')" 2>/dev/null; then
  "$VENV_PYTHON" -m pip install --quiet --no-deps "keras-hub==$KERAS_HUB"
fi
if [ "${AUTOCAST_CORPUS_SETUP_ONLY:-}" = 1 ]; then  # .ci/run sets the venvs up beside the other lanes
  echo "corpus: virtualenvs ready in $SECONDS s"
  exit 0
fi
cd "$PROJECT_ROOT"
"$VENV_PYTHON" -c 'import sys, jax; print(f"=== corpus: python {sys.version.split()[0]}, jax {jax.__version__}")'
start=$SECONDS
# One pytest run per environment, at the same time: two workers for .venv-corpus (a file
# stays on one worker), one for recurrentgemma's file, whose output follows the first's.
rg_log="$(mktemp)"
"$rg_python" -m pytest -p no:cacheprovider -q "$RG_FILE" "$@" >"$rg_log" 2>&1 &
rg_pid=$!
# pytest's exit 5 (no test selected) in one environment is not a failure when arguments
# select tests of the other (`-k griffin` selects nothing in .venv-corpus, `-k jax_md`
# nothing in .venv-corpus-rg); in both, or without arguments, it is
main_rc=0
"$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 -q tests/real_models --ignore="$RG_FILE" "$@" || main_rc=$?
rg_rc=0
wait "$rg_pid" || rg_rc=$?
for rc in "$main_rc" "$rg_rc"; do
  if [ "$rc" != 0 ] && ! { [ "$rc" = 5 ] && [ $# -gt 0 ] && [ "$main_rc$rg_rc" != 55 ]; }; then status=1; fi
done
echo "=== corpus: $RG_FILE (.venv-corpus-rg)"
cat "$rg_log"
rm -f "$rg_log"
echo "corpus lane: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s (after the virtualenvs)"
exit $status
