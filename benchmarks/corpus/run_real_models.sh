#!/usr/bin/env bash
# The real-model corpus's results table (benchmarks/results/corpus/real-models.md and .json):
# every model of tests/real_models/ in float32, float16 and bfloat16, in the corpus lane's
# two virtualenvs (made by tests/run_corpus.sh, which this calls with --co to set them up).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash tests/run_corpus.sh --co -q >/dev/null
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" KERAS_BACKEND=jax
out=.cache/real-models
main_files=(test_attention test_gemma test_keras_hub test_diffrax test_haiku test_jraph)
more_files=(test_equimo test_numpyro test_jax_md test_penzai test_mixtral test_t5 test_diffusers)  # added 2026-11-27: a part of their own (AUTOCAST_PARTS)
parts="${AUTOCAST_PARTS:-main more recurrentgemma}"  # e.g. AUTOCAST_PARTS=more: re-measure one part
for part in $parts; do
  case "$part" in
    main) .venv-corpus/bin/python -m benchmarks.corpus.real_models --part main --out-dir "$out" --files "${main_files[@]}" ;;
    more) .venv-corpus/bin/python -m benchmarks.corpus.real_models --part more --out-dir "$out" --files "${more_files[@]}" ;;
    recurrentgemma) .venv-corpus-rg/bin/python -m benchmarks.corpus.real_models --part recurrentgemma --out-dir "$out" --files test_recurrentgemma ;;
    *) echo "unknown part '$part' in AUTOCAST_PARTS (allowed: main, more, recurrentgemma)" >&2; exit 2 ;;
  esac
done
# the table joins every part's latest JSON in $out (a part not re-measured keeps its earlier one)
.venv-corpus/bin/python -m benchmarks.corpus.real_models --render "$out/main.json" "$out/more.json" "$out/recurrentgemma.json" \
  --command "bash benchmarks/corpus/run_real_models.sh"
