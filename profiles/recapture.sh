#!/usr/bin/env bash
# Re-record the profiled CPU captures (needs the [capture] extra): as traces/recapture.sh, with a PyTorch profiler
# (Kineto) trace per rank beside the event log (`capture --profile`, docs/traces.md). They live apart from traces/
# because the profiler slows the run: `ingest traces` (the calibration store) must not take them in. Small shapes
# and 2 iterations keep each torch_profile/rank-<r>.json.gz under 0.8 MB (the Python call stack is most of it).
# Usage: profiles/recapture.sh [RUN_ID ...]      (default: both; existing ones are replaced)
set -euo pipefail
cd "$(dirname "$0")"
HOPS_CALIB="${HOPS_CALIB:-python -m hops_calib}"

declare -A RUNS=(
  [cpu_1f1b_l2_h256_s128_m4_prof_run1]="--layers 2 --hidden 256 --heads 4 --seq 128 --microbatches 4"
  [cpu_interleaved_v2_l4_h256_s128_m2_prof_run1]="--vp 2 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 2"
)

ids=("$@")
[ ${#ids[@]} -gt 0 ] || mapfile -t ids < <(printf '%s\n' "${!RUNS[@]}" | sort)
for id in "${ids[@]}"; do
  [ -n "${RUNS[$id]:-}" ] || { echo "unknown run id $id" >&2; exit 2; }
  # shellcheck disable=SC2086
  $HOPS_CALIB capture --pp 2 --iterations 2 --link-bench-iters 20 --profile ${RUNS[$id]} --out "$id" --force
done
