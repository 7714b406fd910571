#!/usr/bin/env bash
# The zoo's torch.compile figures on a GPU machine: the pre-warm (every compiled peer of MODELS
# built into inductor's on-disk caches, CPUs − 2 at a time), then the zoo bench with --compile at
# the compile batches, train and infer, whose compiles are then cache hits. From the checkout
# root, with the staged bench (../shared/tools/stage-gpu.sh) or, where there is none, cargo:
#
#   MODELS=mlp,lenet5 bash benches/peers/compile-run.sh
#
# Settings (environment): MODELS (required), DEVICES (gpu,gpu-tf32), BATCHES (8,64,512),
# JOBS (CPUs − 2), PYTHON (python3, as the bench's default), OUT (logs and the bench's files;
# default target/flatnn-bench/compile), PREWARM (1: pre-warm then bench; only: pre-warm alone;
# 0: bench alone), PREWARM_S (300: the pre-warm's time limit; what it finished stays cached, and
# the bench does not start after an unfinished pre-warm). The caches live in target/torchinductor
# (TORCHINDUCTOR_CACHE_DIR to move them) and persist between runs on the same machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
models=${MODELS:?set MODELS=a,b,... (cargo bench --bench zoo -- --help lists them)}
devices=${DEVICES:-gpu,gpu-tf32}
batches=${BATCHES:-8,64,512}
python=${PYTHON:-python3}
out=${OUT:-target/flatnn-bench/compile}
prewarm=${PREWARM:-1}
cpus=$(nproc)
jobs=${JOBS:-$((cpus > 3 ? cpus - 2 : 1))}
mkdir -p "$out"

if [ "$prewarm" != 0 ]; then
  timeout "${PREWARM_S:-300}" "$python" benches/peers/zoo.py --prewarm --jobs "$jobs" --models "$models" \
    --devices "$devices" --tasks train,infer --batches "$batches" 2>&1 | tee "$out/prewarm.log"
  status=${PIPESTATUS[0]}
  if [ "$status" = 124 ]; then
    echo "compile-run: the pre-warm ran past ${PREWARM_S:-300} s; what finished is cached: run again to finish it" >&2
    exit 124
  elif [ "$status" != 0 ]; then
    echo "compile-run: the pre-warm failed (exit $status; see $out/prewarm.log)" >&2
    exit "$status"
  fi
  [ "$prewarm" = only ] && exit 0
fi

args=(--compile --models "$models" --devices "$devices" --tasks train,infer --batches "$batches" --python "$python" --out "$out")
if [ -x .gpu-stage/benches/zoo ]; then
  bash .gpu-stage/run.sh bench zoo "${args[@]}" 2>&1 | tee "$out/zoo.log"
else
  cargo bench --bench zoo -- "${args[@]}" 2>&1 | tee "$out/zoo.log"
fi
exit "${PIPESTATUS[0]}"
