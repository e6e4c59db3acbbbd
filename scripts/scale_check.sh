#!/usr/bin/env bash
# The coordinator's delivery as cores grow, read from one run (issue 41): bench_fanout's table at
# 1, 2, 4, 8 and 16 cores (those this machine has), the whole benchmark pinned to them with
# taskset: coordinator, workers, senders, relays and the lean rank clients alike, so a row says
# what that many cores deliver, clients included. Lean clients cost about a tenth of what the
# coordinator spends a token slot (bench_fanout.py), so they bound no row here.
#
#   scripts/scale_check.sh [OUT_DIR]        # CORES="4 8 16" WORLDS=256,1024 TOKENS=50e6 to change
#
# About 5 minutes on 16 cores at the defaults. The columns to read: tokens/s (token slots
# delivered a second, the goal at 16 cores >= 100M), p99/p50 of the batch gap (<= 3), and
# coord ns/slot (the coordinator's own CPU per delivered token slot; the goal <= 10 ns).
set -u
out=${1:-/tmp/scale_check}
mkdir -p "$out"
have=$(nproc)
cores=${CORES:-"1 2 4 8 16"}
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
  taskset -c "0-$((n - 1))" python3 scripts/bench_fanout.py --worlds "$worlds" --modes "$modes" \
    --tokens "$tokens" --procs "$procs" 2>&1 | tee "$out/fanout-$n.log" | grep -v "^ns/slot:"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench_fanout failed at $n cores (log: $out/fanout-$n.log)"; failed=1; }
done
ls /dev/shm | grep -c '^omniload' | xargs echo "omniload segments left in /dev/shm:"
exit "$failed"
