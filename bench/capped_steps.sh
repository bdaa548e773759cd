#!/usr/bin/env bash
# bench/capped_steps.sh [OUT] [RATES] [NRANKS]
#
# The step-time benchmark on a really capped network: a ResNet-50-sized gradient (25,557,032
# floats in ~25 MB buckets) on NRANKS ranks (default 4), at each RATE (default "1gbit 500mbit"),
# every gradcomp compressor against the fp32 and fp16 allreduce and PyTorch's own hooks over gloo,
# all on the same capped link (bench/capped.sh). Results: OUT/capped-RATE.json (default OUT:
# results/bench), then the summary, CSV and figures are rebuilt with `python -m gradcomp report`.
# Needs root (exits 77 without, like capped.sh). REPEATS / WARMUP / METHODS / ORDER (round-robin,
# the default, or blocks: each method's steps together, as in training) override the defaults;
# MODEL=bert-base runs BERT-base's parameter shapes instead (give it its own OUT folder).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
OUT=${1:-results/bench}
RATES=${2:-1gbit 500mbit}
NRANKS=${3:-4}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
mkdir -p "$OUT"
for rate in $RATES; do
    echo "== $rate x $NRANKS ranks ==" >&2
    "$HERE/capped.sh" "$rate" "$NRANKS" "$PY" -m gradcomp.bench.worker --model "${MODEL:-resnet50}" \
        --methods "${METHODS:-all}" --repeats "${REPEATS:-5}" --warmup "${WARMUP:-3}" --order "${ORDER:-round-robin}" \
        --out "$OUT/capped-$rate.json"
done
"$PY" -m gradcomp report "$OUT"
