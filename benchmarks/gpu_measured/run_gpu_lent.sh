#!/usr/bin/env bash
# The measured benchmark on a lent GPU machine (docs/gpu-benchmark.md, "Measured on a lent GPU"):
# its image has JAX with CUDA, Equinox and optax but no network and no install of this package.
#   bash benchmarks/gpu_measured/run_gpu_lent.sh COMMIT [SECTION ...]   # from the repository root; results under $OUT
# COMMIT names the code in the results (the copy may lack its .git); SECTIONs (1-5, attention
# and loss_head, below; 1-5 by default) pick the runs, so that a lease can be split over calls.
# AUTOCAST_LENT_SMOKE=1: the same runs at the smoke sizes (a dry run on any machine, CPU too;
# tests/test_gpu_benchmark_smoke.py runs `attention` so, tests/test_gpu_lent_rounds.py `loss_head`). MPX, where it is not installed there,
# travels as a copy of its package folder in .whl/site/mpx (PYTHONPATH; git ignores .whl/site,
# `site/` in .gitignore: the device tool must carry it). The attention section compiles each item's systems
# first, all in one process, then times them in rotated rounds (see `attention` below).
# The runs go from the most to the least wanted (on an H200 about 75 s a step of GPT-2 small
# before the shared compilation cache, half of it compiling the model's initialisation: a
# 15-minute lease measures eight to twelve), each section written as soon as it is
# measured and packed every 20 s, so a run cut short by the lease keeps what it measured:
# $OUT/results.tgz (the .md/.json reports), $OUT/hlo.tar (each step's optimised HLO, for
# `benchmarks.gpu_measured.gpu.reanalyse` and `benchmarks.gpu_modeled.kernel_breakdown`, and the first runs' GPU time per
# kernel, for `python -m benchmarks.gpu_measured.kernel_times`), $OUT/log.txt.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# the policies as the wheel maps them (pyproject.toml package-dir): autocast.policies
[ -e autocast/policies ] || ln -s ../policies autocast/policies
export PYTHONPATH=$PWD/.whl/site PYTHONUNBUFFERED=1 AUTOCAST_GIT_COMMIT=${1:?the commit the tree is}
OUT=${OUT:?set OUT to the folder the results go to}
T=${AUTOCAST_LENT_TMP:-/tmp}; R=$T/res; H=$T/hlo; mkdir -p $R $H
log=$OUT/log.txt
t0=$(date +%s)
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
  python3 -c "import jax,equinox,optax;print('jax',jax.__version__,'eqx',equinox.__version__,'optax',optax.__version__,jax.devices())"
} 2>&1 | tee -a "$log"
pack() {
  tar czf "$OUT/partial.tgz" -C "$T" res && mv "$OUT/partial.tgz" "$OUT/results.tgz"
  tar cf "$OUT/partial-hlo.tar" -C "$T" hlo && mv "$OUT/partial-hlo.tar" "$OUT/hlo.tar"
}
(while sleep 20; do pack 2>/dev/null; done) >/dev/null 2>&1 &
packer=$!
trap 'kill $packer 2>/dev/null; pack 2>/dev/null' EXIT
smoke=(); [ "${AUTOCAST_LENT_SMOKE:-0}" = 1 ] && smoke=(--smoke)
run() {
  echo "== $(($(date +%s) - t0)) s: $*" | tee -a "$log"
  PYTHON=python3 bash benchmarks/gpu_measured/run_gpu.sh "$@" ${smoke[@]+"${smoke[@]}"} --save-hlo $H 2>&1 | grep --line-buffered -v "^|" | tee -a "$log"
  pack
}
# AUTOCAST_LENT_DEADLINE_S: start nothing new after that many seconds (what was started finishes
# and is packed), so that a command ends before the lease's per-command limit cuts it
late() {
  local d=${AUTOCAST_LENT_DEADLINE_S:-0} now=$(($(date +%s) - t0))
  if [ "$d" -gt 0 ] && [ "$now" -ge "$d" ]; then
    echo "== $now s: past AUTOCAST_LENT_DEADLINE_S=$d, skipped: $*" | tee -a "$log"
    return 0
  fi
  return 1
}
# AUTOCAST_LENT_ROUNDS_END_S (default: the deadline + 90 s): no timing round starts after that
# many seconds; the rounds run are reported (every system the same rounds, at least one)
end_s=${AUTOCAST_LENT_ROUNDS_END_S:-}
[ -z "$end_s" ] && [ "${AUTOCAST_LENT_DEADLINE_S:-0}" -gt 0 ] && end_s=$((AUTOCAST_LENT_DEADLINE_S + 90))
stop_rounds=(); [ -n "$end_s" ] && stop_rounds=(--stop-rounds-at $((t0 + end_s)))
# XLA's autotuning results shared by the processes of a section (one per system in sections
# 1-5; one per item in attention): the bf16 systems of a model tune mostly the same GEMMs. Only where this XLA takes the flag (an
# unknown XLA flag aborts the process).
autotune_cache() {
  local flag=--xla_gpu_per_fusion_autotune_cache_dir=$T/autotune
  [[ "${XLA_FLAGS:-}" == *autotune_cache_dir* ]] && return
  mkdir -p "$T/autotune"
  if XLA_FLAGS="$flag" python3 -c "import jax; jax.devices()" >/dev/null 2>&1; then
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flag"
    echo "autotuning shared: $flag" | tee -a "$log"
  fi
}
all=(fp32 autocast-bf16 autocast-fp8 mpx-bf16)
section() {
  case $1 in
  # 1. where amp bf16's step time goes against MPX's, kernel by kernel (2026-11-26: 1.16x measured,
  #    1.04x modeled), and what the float32 islands' recomputation costs (amp without it)
  1) run --models gpt2-small --systems autocast-bf16 autocast-bf16-noremat mpx-bf16 --modes triton --kernel-times --out-dir $R/a ;;
  # 2. float8 where it is used in practice: the 1B GPT (modeled 1.16x over bf16)
  2) run --models gpt-1b --systems autocast-bf16 autocast-fp8 --modes triton --kernel-times --out-dir $R/b ;;
  # 3. the batch where fp8 turns on in GPT-2 small, and the x4 speed-ups over fp32
  3) run --models gpt2-small --batch-mults 4 --systems autocast-bf16 mpx-bf16 autocast-fp8 fp32 --modes triton --out-dir $R/c ;;
  # 4. ViT-Base; 5. the cuBLAS mode
  4) run --models vit-base --systems "${all[@]}" --modes triton --out-dir $R/d ;;
  5) run --models gpt2-small gpt-1b --systems autocast-bf16 autocast-fp8 mpx-bf16 --modes cublas --out-dir $R/e ;;
  # attention (issue 41): amp's fused attention against amp as written, MPX and float32: the
  # micro-benchmark at GPT-2 small's shapes (five ways, fwd + bwd: ms, XLA temp, cuDNN calls,
  # gradient error), then the train steps of GPT-2 small, BERT-base (key-padding masks) and
  # ViT-Base (197 tokens, padded for cuDNN), the most wanted first; attention-micro,
  # attention-gpt2, attention-bert, attention-vit: one item each (to split it over calls).
  # Issue 47: on a shared GPU one system timed after another cannot be ranked (two identical
  # programs a minute apart: 30 %). Each item is one process: every system (variant) compiled
  # first, AUTOCAST_LENT_COMPILE_THREADS (4) at a time, all resident, then timed in rotated
  # rounds (AUTOCAST_LENT_ROUNDS x AUTOCAST_LENT_ROUND_STEPS, 5 x 5; benchmarks/gpu_measured/rounds.py):
  # medians with their spread, ratios within each round, each program's hash
  attention) for t in attention-micro attention-gpt2 attention-bert attention-vit; do section $t; done ;;
  attention-micro)
    autotune_cache
    late "$1" && return
    echo "== $(($(date +%s) - t0)) s: attention micro-benchmark" | tee -a "$log"
    python3 -m benchmarks.gpu_measured.attention ${smoke[@]+"${smoke[@]}"} --rounds "${AUTOCAST_LENT_ROUNDS:-5}" \
      --out-dir $R/attention 2>&1 | tee -a "$log"
    pack ;;
  attention-gpt2|attention-bert|attention-vit)
    autotune_cache
    local m=${1#attention-}; m=${m/gpt2/gpt2-small}; m=${m/bert/bert-base}; m=${m/vit/vit-base}
    late "$1" && return
    run --models $m --systems autocast-bf16 autocast-bf16-xla-attention mpx-bf16 fp32 --modes triton \
      --isolate no --rounds "${AUTOCAST_LENT_ROUNDS:-5}" --round-steps "${AUTOCAST_LENT_ROUND_STEPS:-5}" \
      --compile-threads "${AUTOCAST_LENT_COMPILE_THREADS:-4}" ${stop_rounds[@]+"${stop_rounds[@]}"} \
      --out-dir $R/attention-$m ;;
  # loss_head (issue 49): amp's loss head chunked over tokens (autocast-bf16, loss_head="auto")
  # against the head and its loss as written (autocast-bf16-xla-loss-head) and MPX, GPT-2 small.
  # loss-head-gpt2: the train step at batch x1 in rotated rounds, as attention-gpt2 (~90 s cold).
  # loss-head-batch: the largest batch that fits, per amp system: one process each (the model
  # made once, each batch compiled and run in it: --isolate no --largest-batch), the batch
  # multiples AUTOCAST_LENT_LOSS_HEAD_MULTS in increasing order until the first that fails, the
  # allocator given AUTOCAST_LENT_MEM_FRACTION (.95) of the GPU instead of JAX's .75. Expected on
  # an H200 (143 GiB; deviceless H100 figures: 1.4 GiB of state, ~3.2 GiB of temp a batch x1 as
  # written, ~2.1 chunked): as written up to ~x40, chunked ~x60, so the default multiples
  # (32 48 64 96) stop after 2-4 runs of ~20 s compile and ~1-2 s a step: ~4 min for both
  # (XLA:GPU may rematerialise a step to fit, so a batch can fit that the figures say cannot).
  loss_head) for t in loss-head-gpt2 loss-head-batch; do section $t; done ;;
  loss-head-gpt2)
    autotune_cache
    late "$1" && return
    run --models gpt2-small --systems autocast-bf16 autocast-bf16-xla-loss-head mpx-bf16 --modes triton \
      --isolate no --rounds "${AUTOCAST_LENT_ROUNDS:-5}" --round-steps "${AUTOCAST_LENT_ROUND_STEPS:-5}" \
      --compile-threads "${AUTOCAST_LENT_COMPILE_THREADS:-4}" ${stop_rounds[@]+"${stop_rounds[@]}"} \
      --out-dir $R/loss-head-gpt2-small ;;
  loss-head-batch)
    autotune_cache
    local s mults
    read -ra mults <<< "${AUTOCAST_LENT_LOSS_HEAD_MULTS:-32 48 64 96}"
    for s in autocast-bf16-xla-loss-head autocast-bf16; do
      late "$1 $s" && continue
      XLA_PYTHON_CLIENT_MEM_FRACTION=${AUTOCAST_LENT_MEM_FRACTION:-.95} \
        run --models gpt2-small --systems $s --modes triton --isolate no --largest-batch \
        --batch-mults "${mults[@]}" --warmup 1 --repeats 2 --out-dir $R/loss-head-batch-$s
    done ;;
  *) echo "unknown section $1 (1-5, attention, attention-micro, attention-gpt2, attention-bert, attention-vit," \
    "loss_head, loss-head-gpt2, loss-head-batch)" | tee -a "$log" ;;
  esac
}
shift
for s in "${@:-1 2 3 4 5}"; do for t in $s; do section "$t"; done; done
echo "== done $(($(date +%s) - t0)) s" | tee -a "$log"
