#!/usr/bin/env bash
# The coordinator's delivery as cores grow, read from one run (issue 41): bench_fanout's table
# at 4, 8 and 16 cores (those this machine has; 1 and 2 on a smaller one), the whole benchmark
# pinned to them with taskset: coordinator, workers, senders, relays and the lean rank clients
# alike, so a row says what that many cores deliver with the clients' cost counted in; the
# ns/slot column is the coordinator's own, whatever the clients take.
#
#   scripts/scale_check.sh [OUT_DIR]        # CORES="4 8 16" WORLDS=256,1024 TOKENS=50e6 to change
#
# 3 min 50 s on a 2-core machine (1 and 2 cores, 2026-11-28); not yet timed on a larger one.
# The columns to read: tokens/s (token slots delivered a second; the goal at 16 cores is
# >= 100M), p99/p50 of the batch gap (<= 3), and ns/slot (the coordinator's own CPU per
# delivered token slot; the goal is <= 10 ns).
set -u
out_arg=${1:+$(realpath -m "$1")}  # before the cd below: a relative OUT_DIR is the caller's
cd "$(dirname "$0")/.."  # python -m scripts.* runs from the repository root
out=${out_arg:-/tmp/scale_check}
mkdir -p "$out"
have=$(nproc)
if [ "$have" -ge 4 ]; then default_cores="4 8 16"; else default_cores="1 2"; fi
cores=${CORES:-$default_cores}
worlds=${WORLDS:-256,1024}
tokens=${TOKENS:-50e6}
modes=${MODES:-direct,relay16}
echo "machine: $have cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'))"
failed=0
for n in $cores; do
  if [ "$n" -gt "$have" ]; then
    echo "== $n cores: skipped (this machine has $have)"
    continue
  fi
  echo "== $n cores (taskset -c 0-$((n - 1)))"
  procs=$(( n < 8 ? n : 8 ))
  taskset -c "0-$((n - 1))" python3 -m scripts.bench_fanout --worlds "$worlds" --modes "$modes" \
    --tokens "$tokens" --procs "$procs" 2>&1 | tee "$out/fanout-$n.log" | grep -v "^ns/slot:"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench_fanout failed at $n cores (log: $out/fanout-$n.log)"; failed=1; }
done
ls /dev/shm | grep -c '^omniload' | xargs echo "omniload segments left in /dev/shm:"
exit "$failed"
