#!/usr/bin/env bash
# The checks that need a GPU machine (CI has none), run from the repository root:
#   1. the rank client's CUDA tests (pinned batches are page-locked, device= batches are on the
#      GPU, both the same bytes as plain ones), which skip without CUDA;
#   2. examples/plain/train.py under `omniload launch -- torchrun`: on CPU over gloo (GPU hidden),
#      then on the GPU over NCCL with device=, stopped at a checkpoint and resumed. The GPU
#      run must train exactly the CPU run's batches, each step once.
#
#   scripts/gpu_check.sh [OUT_DIR]      # exit status: 0 when every check passed
#
# One GPU is enough: NCCL cannot put two ranks on one GPU, so the NCCL run has one rank
# (a tp broadcast over NCCL needs a GPU per rank and is not checked here).
set -u
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
export NCCL_DEBUG=VERSION  # NCCL prints its version when a communicator starts: the GPU run used it

python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
  torch.cuda.get_device_name() if torch.cuda.is_available() else "", "nccl", torch.cuda.nccl.version())'

echo "== 1. the rank client's tests (CUDA ones run here)"
python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_client.py tests/integration/test_client.py \
  2>&1 | tee "$out/client_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

echo "== 2. examples/plain/train.py: CPU over gloo, then GPU over NCCL stopped and resumed"
corpus=$(python3 -c "from omniload.demo.corpus import make_corpus; print(make_corpus('$work/corpus'))")
job=(--source "stdlib=$corpus/stdlib/*.parquet" --source "short=$corpus/short/*.jsonl"
  --seq-len 256 --rows 4 --steps 16 --seed 1)
train() {  # train NAME [CUDA_VISIBLE_DEVICES] -- ARGS...: one launch + torchrun run, its log under $out
  local name=$1 visible=$2
  shift 3
  env ${visible:+CUDA_VISIBLE_DEVICES=$visible} python3 -m omniload.cli launch "${job[@]}" -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node=1 examples/plain/train.py \
    --checkpoint-dir "$work/ckpt-$name" --save-every 8 --record "$work/$name-{rank}.jsonl" "$@" \
    >"$out/train-$name.log" 2>&1 || { echo "$name run failed (log: train-$name.log)"; tail -20 "$out/train-$name.log"; failed=1; }
}
train cpu "-1" -- --steps 16
train gpu "" -- --steps 8
cp -r "$work/ckpt-gpu" "$work/ckpt-gpu-resumed"
train gpu-resumed "" -- --steps 18 --resume
grep -h "backend\|nccl\|NCCL" "$out"/train-gpu*.log | head -5
python3 - "$work" <<'EOF' || failed=1
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
def steps(name):
    lines = [json.loads(l) for l in (work / f"{name}-0.jsonl").read_text().splitlines()]
    seen = {e["step"]: e["digest"] for e in lines}
    assert len(seen) == len(lines), f"{name}: a step was trained twice"
    return seen
cpu, before, after = steps("cpu"), steps("gpu"), steps("gpu-resumed")
assert sorted(cpu) == list(range(16)), f"cpu run trained steps {sorted(cpu)}"
assert sorted(before) == list(range(8)) and sorted(after) == list(range(8, 16)), (sorted(before), sorted(after))
assert {**before, **after} == cpu, "the GPU run trained other batches than the CPU run"
print("GPU (NCCL, device=) stopped at step 8 and resumed: the CPU run's 16 batches, each once")
EOF
ls /dev/shm | grep -c '^omniload' | xargs echo "omniload segments left in /dev/shm:"
[ "$failed" -eq 0 ] && echo "gpu_check: every check passed" || echo "gpu_check: FAILED"
exit "$failed"
