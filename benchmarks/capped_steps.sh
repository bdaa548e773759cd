#!/usr/bin/env bash
# benchmarks/capped_steps.sh [OUT] [RATES] [NRANKS]
#
# The step-time benchmark on a really capped network: a ResNet-50-sized gradient (25,557,032
# floats in ~25 MB buckets) on NRANKS ranks (default 4), at each RATE (default "1gbit 500mbit"),
# every gradcomp compressor in gradcomp.REGISTRY (plus the targets' PowerSGD specs) against the
# fp32 and fp16 allreduce and PyTorch's own hooks over gloo, all on the same capped link
# (benchmarks/capped.sh), on each worker path:
#   reducer  GradientReducer on NumPy arrays (the README path)    -> OUT/capped-RATE-reducer.json
#   ddp      DistributedDataParallel, each method its comm hook   -> OUT/capped-RATE-ddp.json
# then the summary, CSV and figures are rebuilt with `python -m benchmarks report OUT` (default OUT:
# results/bench). Needs root (exits 77 without, like capped.sh).
#
# Environment:
#   PATHS="reducer ddp"  the worker paths to run (default both; "reducer" or "ddp" for one)
#   REDUCER_ARRAYS=views (default: gradients in GradientReducer.gradients) or own (copied in/out)
#   REPEATS / WARMUP / METHODS / ORDER (blocks, the default: each method built, warmed up and timed
#   before the next is built, so one method's memory is alive at a time -- every registered method
#   at once, round-robin, needs over 24 GiB at 4 ranks and was OOM-killed here; or round-robin:
#   one timed step of each method in turn, fairer under changing load, for a few methods) override the worker's defaults; METHODS takes compressor specs
#   (powersgd:rank=4,start_iter=2), torch-* hooks, gloo-SPEC, all (see benchmarks.methods).
#   BUCKET_VIEW=off: the ddp path's DDP with gradient_as_bucket_view=False (DDP's default; the
#   worker's default, on, is what the README writes).
#   MODEL=bert-base runs BERT-base's parameter shapes instead (give it its own OUT folder).
#   MPICH_RING=1 adds, per RATE, an explicit comparison run with MPICH's ring allreduce selected
#   (MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring, not a default: capped.sh sets no MPICH algorithm
#   or allocator variable itself): gradcomp's fp32 allreduce and mpi-allreduce (one MPI_Allreduce
#   per bucket) on the reducer path, rows tagged "(MPICH ring, tuned)", in
#   OUT/capped-RATE-reducer-mpich-ring.json. The target it checks: gradcomp's fp32 step no slower
#   than MPICH's best algorithm for the same bytes (mpi-allreduce's "/ fp32" column <= 1 means
#   MPICH's ring beats gradcomp's reduce-scatter + allgather on this link).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=${1:-results/bench}
RATES=${2:-1gbit 500mbit}
NRANKS=${3:-4}
PATHS=${PATHS:-reducer ddp}
PY=${PYTHON:-$ROOT/.venv/bin/python}
# the benchmarks package is not installed: the workers import it from the checkout
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -x "$PY" ] || PY=$(command -v python3)
for path in $PATHS; do
    case "$path" in reducer|ddp) ;; *) echo "capped_steps.sh: unknown path '$path' (reducer, ddp)" >&2; exit 2;; esac
done
mkdir -p "$OUT"
worker() {  # worker RATE PATH OUTFILE [extra worker options...]
    local rate=$1 path=$2 out=$3
    shift 3
    "$HERE/capped.sh" "$rate" "$NRANKS" "$PY" -m benchmarks.worker --path "$path" \
        --model "${MODEL:-resnet50}" --repeats "${REPEATS:-5}" --warmup "${WARMUP:-3}" \
        --order "${ORDER:-blocks}" --reducer-arrays "${REDUCER_ARRAYS:-views}" \
        --bucket-view "${BUCKET_VIEW:-on}" --out "$out" "$@"
}
for rate in $RATES; do
    for path in $PATHS; do
        echo "== $rate x $NRANKS ranks, $path path ==" >&2
        worker "$rate" "$path" "$OUT/capped-$rate-$path.json" --methods "${METHODS:-all}"
    done
    if [ "${MPICH_RING:-0}" = 1 ]; then
        echo "== $rate x $NRANKS ranks, reducer path, MPICH ring (MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring) ==" >&2
        MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring worker "$rate" reducer "$OUT/capped-$rate-reducer-mpich-ring.json" \
            --methods allreduce,mpi-allreduce --tag "MPICH ring, tuned"
    fi
done
"$PY" -m benchmarks report "$OUT"
