#!/usr/bin/env bash
# benchmarks/fsdp_steps.sh [OUT] [RATE] [NRANKS]
#
# FSDP2 step times on a capped network (benchmarks/capped.sh): examples/torch_fsdp.py's transformer LM,
# sized so that its gradients are tens of MB, once per method and repeat, the methods taking turns
# (round-robin, so slow moments of a shared machine spread over all of them), each run printing
# its median step; then one table of the medians over repeats and their ratio to FSDP's own
# reduce-scatter (`none`) from the same runs. Needs root (capped.sh exits 77 without).
#
# Environment: METHODS (default "none int8:warmup=0 int4"; METHOD/CODES also sends the parameter
# all-gathers in CODES: "int8:warmup=0/int8" is torch_fsdp.py --compressor int8:warmup=0 --all-gather int8), REPEATS (3), STEPS (12),
# CAPPED_HOSTS (capped.sh's: 2 hosts of NRANKS/2 ranks, say), MESH=local (shard inside each emulated
# host, compress across hosts: torch_fsdp.py --mesh local), MODEL_ARGS (default
# "--d-model 512 --layers 4 --heads 8 --batch-size 2 --context 64").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/fsdp}
RATE=${2:-1gbit}
NRANKS=${3:-2}
METHODS=${METHODS:-"none int8:warmup=0 int4"}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-12}
MODEL_ARGS=${MODEL_ARGS:-"--d-model 512 --layers 4 --heads 8 --batch-size 2 --context 64"}
MESH_ARGS=${MESH:+--mesh $MESH}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for ((r = 0; r < REPEATS; r++)); do
    for m in $METHODS; do
        tag=$(echo "$m" | tr ':=,/' '____')
        gather=()
        [[ "$m" == */* ]] && gather=(--all-gather "${m#*/}")
        OMP_NUM_THREADS=1 benchmarks/capped.sh "$RATE" "$NRANKS" "$PY" examples/torch_fsdp.py --compressor "${m%%/*}" "${gather[@]}" \
            --steps "$STEPS" --eval-every 100000 --val-windows 8 $MODEL_ARGS $MESH_ARGS \
            --json "$OUT/$tag-r$r.json" > "$OUT/$tag-r$r.log" 2>&1 || { echo "failed: $m (see $OUT/$tag-r$r.log)"; exit 1; }
        grep "under FSDP2" "$OUT/$tag-r$r.log" || true
    done
done
"$PY" - "$OUT" $METHODS <<'PY'
import json, statistics, sys
from pathlib import Path
out, methods = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for m in methods:
    tag = m.replace(":", "_").replace("=", "_").replace(",", "_").replace("/", "_")
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}-r*.json"))]
    rows[m] = (statistics.median(r["step_ms_median"] for r in runs), runs[-1].get("compression_ratio"),
               [round(r["step_ms_median"]) for r in runs], runs[-1].get("all_gather_ratio"))
base = rows.get("none", (None,))[0]
print("| method | step ms (median of repeats) | / FSDP's own | bytes vs FSDP's reduce-scatter | all-gathers | repeats ms |")
print("|---|---:|---:|---:|---:|---|")
for m, (ms, ratio, each, gather) in rows.items():
    rel = f"{ms / base:.2f}" if base else ""
    print(f"| {m} | {ms:.0f} | {rel} | {f'{ratio:.2f}x fewer' if ratio else '1x'} | "
          f"{f'{gather:.2f}x fewer' if gather else '1x'} | {each} |")
PY
