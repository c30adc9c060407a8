#!/usr/bin/env bash
# Re-record the shipped CPU captures (needs the [capture] extra): Megatron-core's own schedules on 2 CPU
# ranks, each pinned to its own core with one thread. Other work on the machine inflates and spreads the
# timings, so each capture waits (up to WAIT_S seconds) until on average at most MAX_BUSY other processes
# are runnable; the load average at its start and end is kept in each run's manifest.yaml.
# Usage: traces/recapture.sh [RUN_ID ...]      (default: every run below; existing ones are replaced)
set -euo pipefail
cd "$(dirname "$0")"
HOPS_CALIB="${HOPS_CALIB:-python -m hops_calib}"
MAX_BUSY="${MAX_BUSY:-0.5}"
WAIT_S="${WAIT_S:-300}"

declare -A RUNS=(
  [cpu_1f1b_l4_h512_s256_m4_run1]="--layers 4 --hidden 512 --seq 256 --microbatches 4"
  [cpu_1f1b_l4_h512_s256_m4_run2]="--layers 4 --hidden 512 --seq 256 --microbatches 4"
  [cpu_1f1b_l4_h768_s256_m8_run1]="--layers 4 --hidden 768 --seq 256 --microbatches 8"
  [cpu_1f1b_l4_h512_s512_m6_run1]="--layers 4 --hidden 512 --seq 512 --microbatches 6"
  [cpu_1f1b_l6_h384_s256_m4_run1]="--layers 6 --hidden 384 --heads 6 --seq 256 --microbatches 4"
  [cpu_interleaved_v2_l8_h512_s256_m4_run1]="--vp 2 --layers 8 --hidden 512 --seq 256 --microbatches 4"
  [cpu_interleaved_v2_l8_h512_s256_m4_run2]="--vp 2 --layers 8 --hidden 512 --seq 256 --microbatches 4"
  [cpu_interleaved_v2_l4_h640_s384_m6_run1]="--vp 2 --layers 4 --hidden 640 --heads 10 --seq 384 --microbatches 6"
  # tensor and data parallelism (issue #19): 4 and 8 ranks on the 2 cores, so ranks share cores (manifest:
  # ranks_share_cores); tiny shapes, 20 timed sends per link-benchmark size
  [cpu_1f1b_t2_l4_h256_s128_m4_run1]="--tp 2 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 4 --iterations 4 --link-bench-iters 20"
  [cpu_1f1b_d2_l4_h256_s128_m4_run1]="--dp 2 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 4 --iterations 4 --link-bench-iters 20"
  [cpu_1f1b_t2d2_l4_h256_s128_m4_run1]="--tp 2 --dp 2 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 4 --iterations 4 --link-bench-iters 20"
  # the same structure in other shapes, ingested into the train split (`--split train`) so the CPU pricing of
  # tensor- and data-parallel collectives can be calibrated: fewer traced iterations keep each under 250 KB (8 ranks log twice as much: 3 microbatches there)
  [cpu_1f1b_t2_l4_h384_s128_m4_run1]="--tp 2 --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 4 --iterations 3 --link-bench-iters 20"
  [cpu_1f1b_t2_l4_h256_s256_m4_run1]="--tp 2 --layers 4 --hidden 256 --heads 4 --seq 256 --microbatches 4 --iterations 3 --link-bench-iters 20"
  [cpu_1f1b_d2_l4_h384_s128_m4_run1]="--dp 2 --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 4 --iterations 4 --link-bench-iters 20"
  [cpu_1f1b_t2d2_l2_h384_s128_m3_run1]="--tp 2 --dp 2 --layers 2 --hidden 384 --heads 6 --seq 128 --microbatches 3 --iterations 3 --link-bench-iters 20"
  # the t2 shape without tensor parallelism, on the same (current) capture machine: what the collectives and the
  # sharing of cores add is read against it
  [cpu_1f1b_l4_h384_s128_m4_run1]="--layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 4 --iterations 4 --link-bench-iters 20"
  # interleaved 1F1B with Megatron's overlapped p2p (overlap_p2p_comm, Megatron-LM's default with virtual stages;
  # issue #28): its order of events per rank is checked against the simulator's program in tests/sim/test_overlap_capture.py
  [cpu_interleaved_overlap_v2_l4_h384_s128_m6_run1]="--vp 2 --overlap-p2p --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 6 --iterations 4 --link-bench-iters 20"
  [cpu_interleaved_overlap_v2_l4_h384_s128_m6_run2]="--vp 2 --overlap-p2p --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 6 --iterations 4 --link-bench-iters 20"
  # the same shape without the overlap (blocking p2p), on the same machine: what posting the transfers ahead adds
  # to each task is read against it (issue #28)
  [cpu_interleaved_v2_l4_h384_s128_m6_run1]="--vp 2 --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 6 --iterations 4 --link-bench-iters 20"
  [cpu_interleaved_v2_l4_h384_s128_m6_run2]="--vp 2 --layers 4 --hidden 384 --heads 6 --seq 128 --microbatches 6 --iterations 4 --link-bench-iters 20"
  # Megatron-core's MoE layer on 2 ranks (issue #28): one stage, 2 experts on 2 expert-parallel ranks, top-1
  # (the later --pp 1 and --iterations 3 override the loop's --pp 2 --iterations 6)
  [cpu_moe_e2_ep2_k1_l4_h256_s128_m4_run1]="--pp 1 --dp 2 --ep 2 --experts 2 --topk 1 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 4 --iterations 3 --no-link-bench"
  [cpu_moe_e2_ep2_k1_l4_h256_s128_m4_run2]="--pp 1 --dp 2 --ep 2 --experts 2 --topk 1 --layers 4 --hidden 256 --heads 4 --seq 128 --microbatches 4 --iterations 3 --no-link-bench"
)

# Other work competing for the cores now: runnable processes besides this sampler, averaged over 5 s
# (the load average would also count the previous capture's own ranks for a minute after they end).
busy_now() {
  local total=0
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    total=$((total + $(awk '/^procs_running/ { print $2 - 1 }' /proc/stat))); sleep 0.5
  done
  awk -v t="$total" 'BEGIN { printf "%.1f", t / 10 }'
}

wait_for_quiet() {
  local waited=0 busy
  busy=$(busy_now)
  while awk -v b="$busy" -v max="$MAX_BUSY" 'BEGIN { exit !(b > max) }' && [ "$waited" -lt "$WAIT_S" ]; do
    sleep 10; waited=$((waited + 15)); busy=$(busy_now)
  done
  echo "$(date +%T) other runnable processes ${busy} (waited ${waited}s); load $(cut -d' ' -f1-3 /proc/loadavg)"
}

ids=("$@")
[ ${#ids[@]} -gt 0 ] || mapfile -t ids < <(printf '%s\n' "${!RUNS[@]}" | sort)
for id in "${ids[@]}"; do
  [ -n "${RUNS[$id]:-}" ] || { echo "unknown run id $id" >&2; exit 2; }
  wait_for_quiet
  # shellcheck disable=SC2086
  $HOPS_CALIB capture --pp 2 --iterations 6 ${RUNS[$id]} --out "$id" --force
done
