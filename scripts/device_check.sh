#!/usr/bin/env bash
# The one script to run when a GPU machine is lent (one GPU and 16 cores for about 15 minutes in
# all, a command at most 10): each part under its own time limit, so that a slow one cannot take
# the others' time, its log under OUT_DIR. The limits add up to 9 min 10 s, under a command's 10.
#   1. scripts/gpu_check.sh: the client's CUDA tests, the plain recipe over NCCL stopped and resumed;
#   2. scripts/scale_check.sh at 4, 8 and 16 cores, direct only and 20e6 tokens (issue 41's table);
#   3. bench_quality at a GPU batch size: 64 rows a rank, the model on the GPU, one seed of each
#      arm (issue 40's comparison; CPU runs here use 4-16 rows);
#   4. the torchtitan recipe end to end, where torchtitan imports (it is in no extra the tests
#      install; on a machine that cannot fetch it, carry its wheel: the device tool's README).
#
#   scripts/device_check.sh [OUT_DIR]      # exit status: 0 when every part that ran passed
#
# Written on a machine without a GPU: parts 1-3 ran here only on the CPU (bench_quality
# --device cpu), never yet on a GPU.
set -u
out_arg=${1:+$(realpath -m "$1")}  # before the cd below: a relative OUT_DIR is the caller's
cd "$(dirname "$0")/.."  # python -m scripts.* runs from the repository root
out=${out_arg:-/tmp/device_check}
mkdir -p "$out"
failed=0

part() {  # part NAME SECONDS COMMAND...: run it with its limit, its output in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s)"
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - started))s"
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
part gpu_check 170 scripts/gpu_check.sh "$out/gpu_check"
part scale_check 150 env CORES="4 8 16" WORLDS=256,1024 TOKENS=20e6 MODES=direct scripts/scale_check.sh "$out/scale_check"
part quality 130 python3 -m scripts.bench_quality --corpus bench --rows 64 --steps 150 --seeds 0 \
  --device cuda --threads 8 --json "$out/quality.json"
if python3 -c "import torchtitan" 2>/dev/null; then
  # the benchmarks' 32k BPE (trained here, no download) as both omniload's tokenizer and the
  # model's assets; a first try: torchtitan may want more than tokenizer.json in that folder
  assets="$out/titan-assets"
  mkdir -p "$assets"
  cp "$(python3 -c "from scripts import bench_data; print(bench_data.bpe_tokenizer())")" "$assets/tokenizer.json"
  corpus=$(python3 -c "from omniload.demo.corpus import make_corpus; print(make_corpus('$out/corpus'))")
  part torchtitan 100 python3 -m omniload.cli launch --source "demo=$corpus/stdlib/*.parquet" \
    --tokenizer "$assets/tokenizer.json" --seq-len 256 --rows 4 --steps 20 -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node=1 examples/torchtitan/train.py \
    --hf-assets "$assets" --seq-len 256 --rows 4 --steps 20 --save-every 10 \
    --dump-folder "$out/titan"
else
  echo "== torchtitan: not installed here, not run"
fi
ls /dev/shm | grep -c '^omniload' | xargs echo "omniload segments left in /dev/shm:"
[ "$failed" -eq 0 ] && echo "device_check: every part that ran passed" || echo "device_check: FAILED"
exit "$failed"
