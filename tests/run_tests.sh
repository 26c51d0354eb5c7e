#!/usr/bin/env bash
# Quickstart command 2: run the test suite on CPU in three lanes, each in its own virtualenv
# (created once, re-installed only when pyproject.toml changes):
#   newest:  Python 3.13 with the newest JAX, Flax, Equinox and optax the index serves
#   oldest:  Python 3.11 with the oldest supported JAX (0.9.2), all but OLDEST_SKIP, and a
#            test with float16 and bfloat16 cases in bfloat16 only (tests/conftest.py)
#   nextjax: the newest venv with JAX's upgrade flags on (the encodings JAX moves to:
#            checkpoint, custom_jvp/vjp as call_hi_primitive, softmax's custom_jvp), on the
#            files that exercise higher-order primitives, custom derivatives, models and
#            explain, bfloat16 only where a test has float16 and bfloat16 cases (the flags
#            change encodings, not dtypes); then the forward-only Scan3 file with JAX_SCAN3=1
# Exits non-zero if any fails. One lane only: AUTOCAST_ENVS=newest (or oldest, nextjax).
# Extra arguments go to pytest, e.g. `bash tests/run_tests.sh -k policy`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/venv.sh"
OLDEST_JAX="0.9.2"  # keep in step with pyproject.toml's jax lower bound
envs="${AUTOCAST_ENVS:-newest oldest nextjax}"
NEXTJAX_FLAGS="JAX_REMAT3=1 JAX_CUSTOM_JVP3=1 JAX_CUSTOM_VJP3=1 JAX_SOFTMAX_CUSTOM_JVP=1"
# the whole suite twice more does not fit CI's 30 minutes on 2 cores: these files only
NEXTJAX_FILES="tests/test_idioms.py tests/test_higher_order.py tests/test_custom_derivatives.py tests/test_islands.py
  tests/test_cross_boundary.py tests/test_residual_census.py tests/test_models_equinox.py
  tests/test_models_flax.py tests/test_explain.py tests/test_walk_hijax.py tests/test_fp8.py
  tests/test_attention_autodiff.py tests/test_remat_matmuls.py"
SCAN3_FILE="tests/test_hijax_scan3.py"
# not in the oldest lane (CI's 30 minutes): the benchmark and demo smoke runs, the training
# and accuracy checks (float8, bias gradients, half optimizer state, stochastic rounding,
# accuracy, find_overflow), the jmp/MPX/jaxamp compat layers and migration examples (their
# libraries are pinned, the same in both lanes) and the docs pages' examples. What they check
# is numerics and code whose JAX-facing paths the lane's other files cover (the interpreter,
# every rule, the models, fp8, the scalers, sharding, checkpoints, README's examples); the
# newest lane runs them. Nor the tests of the benchmark tools that read HLO text and timings,
# of the docs' API index and of the package's module structure: the same whatever the JAX.
# (--ignore=docs alone leaves the pages pytest reaches through testpaths' "docs" entry: 53 of
# them ran here until 2026-11-26; the glob drops them all)
OLDEST_SKIP="--ignore=docs --ignore-glob=docs/* --ignore=tests/test_gpu_benchmark_smoke.py --ignore=tests/test_demo.py
  --ignore=tests/test_fp8_models.py --ignore=tests/test_bias_gradients.py --ignore=tests/test_half_optim.py
  --ignore=tests/test_stochastic_rounding.py --ignore=tests/test_accuracy.py --ignore=tests/test_find_overflow.py
  --ignore=tests/test_optim.py --ignore=tests/test_migration.py --ignore=tests/test_compat_jaxamp.py
  --ignore=tests/test_compat_mpx.py --ignore=tests/test_compat_jmp_suite.py --ignore=tests/test_hlo_model.py
  --ignore=tests/test_kernel_breakdown.py --ignore=tests/test_kernel_times.py --ignore=tests/test_docs.py
  --ignore=tests/test_module_structure.py"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fast_cpu_compiles
status=0
summary=()
newest_venv() {
  local py
  if ! py="$(find_python 3.13)"; then
    if [ "${CI:-}" = "true" ]; then
      echo "newest: Python 3.13 not found (install it, e.g. with pyenv)" >&2
      exit 1
    fi
    py="${PYTHON:-python3}"
    echo "newest: Python 3.13 not found; using $py with the newest JAX it can install" >&2
  fi
  ensure_venv .venv-newest "$py" test,checkpoint --upgrade "jax[cpu]"
}
for env in $envs; do
  flags=""
  note=""
  case "$env" in
    newest)
      newest_venv ;;
    nextjax)
      newest_venv ;;
    oldest)
      py="$(find_python 3.11 || echo "${PYTHON:-python3}")"
      ensure_venv .venv-oldest "$py" test,checkpoint "jax[cpu]==$OLDEST_JAX" "jaxlib==$OLDEST_JAX" ;;
    *)
      echo "unknown environment '$env' in AUTOCAST_ENVS (allowed: newest, oldest, nextjax)" >&2
      exit 2 ;;
  esac
  versions="$("$VENV_PYTHON" -c 'import sys, jax, flax, equinox, optax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, equinox {equinox.__version__}, optax {optax.__version__}")')"
  start=$SECONDS
  if [ "$env" = nextjax ]; then
    runs=("env AUTOCAST_HALF_TWINS=bfloat16 $NEXTJAX_FLAGS|$NEXTJAX_FILES")
    if [ -f "$PROJECT_ROOT/$SCAN3_FILE" ]; then
      runs+=("env AUTOCAST_HALF_TWINS=bfloat16 $NEXTJAX_FLAGS JAX_SCAN3=1|$SCAN3_FILE")
      flags="$NEXTJAX_FLAGS, bfloat16 only where a test has float16 and bfloat16 cases; then JAX_SCAN3=1 on $SCAN3_FILE"
    else
      flags="$NEXTJAX_FLAGS ($SCAN3_FILE not present: no JAX_SCAN3 run)"
    fi
  elif [ "$env" = oldest ]; then
    runs=("env AUTOCAST_HALF_TWINS=bfloat16|$OLDEST_SKIP")
    note="bfloat16 only where a test has float16 and bfloat16 cases; not run here: $(skipped="${OLDEST_SKIP//--ignore-glob=docs\/\*/}"; echo ${skipped//--ignore=/})"
  else
    runs=("env|")
  fi
  echo "=== $env: $versions${flags:+; flags: $flags}${note:+; $note}"
  ok=true
  for run in "${runs[@]}"; do  # "env FLAGS|FILES"
    # shellcheck disable=SC2086  # word splitting of the flag and file lists is intended
    (cd "$PROJECT_ROOT" && ${run%%|*} "$VENV_PYTHON" -m pytest -p no:cacheprovider -n 2 -q ${run#*|} "$@") || ok=false
  done
  if $ok; then
    summary+=("$env ($versions${flags:+; flags: $flags}${note:+; $note}): passed in $((SECONDS - start)) s")
  else
    status=1
    summary+=("$env ($versions${flags:+; flags: $flags}${note:+; $note}): FAILED after $((SECONDS - start)) s")
  fi
done
printf '%s\n' "${summary[@]}"
exit $status
