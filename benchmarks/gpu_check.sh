#!/usr/bin/env bash
# Everything a session lent a GPU measures, in one call of about 9 minutes: each stage has its own time limit
# and writes its log and JSON as it ends, so a stage cut short leaves the others' results; all of it goes back
# as $OUT/gpu_check.tgz, with the tables in $OUT/summary.txt (the device tool returns 8 files at most).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on the device machine
#
# torchao travels as a wheel in .whl (the device tool's notes say how): it is installed first where present.
# Stages, in the order of their value (clipping at 1.0 throughout):
#   1. fsdp2: FSDP2 with CPUOffloadPolicy at 1.32B: torch's AdamW(fused=True) on fp32 shards; CPUAdam clipping
#      inside its step, serial and behind the next forward (bf16-SR shards + bf16 and 8-bit moments, fp32 shards +
#      bf16 moments); OffloadOptimizer with the whole share, for the ratio; each FSDP2 contender's timeline for
#      bench_fsdp2_replay.py;
#   2. cap80: a GPU of 80 GiB (set_per_process_memory_fraction), 6.66B (--layers 32 --dim 4096 --heads 32
#      --batch 4): OffloadOptimizer "auto", torchao, FSDP2 + CPUAdam behind the forward (all on the host: 5.5k
#      tokens/s on 2026-11-28, not repeated);
#   3. cap24: a GPU of 24 GiB at batch 1: FSDP2 + CPUAdam behind the forward at 6.66B, then 11.6B (--layers 36
#      --dim 5120 --heads 40), whose bf16 weights do not fit it; the models built in host RAM. OffloadOptimizer
#      there is left out for time: its 13.3 GB of bf16 weights leave about 10 GB for 6.66B's activations, about
#      what batch 1 needs (an estimate; the 2026-12-04 run was cut before it).
#   4. tests: the CUDA tests, every one run (no -x: one failure does not hide the rest).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
WORK=/tmp/gpu_check
mkdir -p "$WORK"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log --oneline -1; } \
  > "$WORK/machine.txt" 2>&1

stage() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most $seconds s)"
  local start=$SECONDS
  timeout "$seconds" "$@" > "$WORK/$name.log" 2>&1
  echo "   exit $?, $((SECONDS - start)) s"
}

python3 -c "from cpu_adam import ops; ops.supported_isas()" > "$WORK/build.log" 2>&1  # the kernels, built once
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
bench=(python3 benchmarks/bench_gpu_offload.py --quiet --split-steps 1 --probe-numel 33554432)
big=(--layers 32 --dim 4096 --heads 32)
stage fsdp2 170 "${bench[@]}" --warmup 2 --steps 3 --timeout 45 --json "$WORK/fsdp2.json" \
  --record-timeline "$WORK/timelines" \
  --contenders fsdp2:sr/bf16/inside/behind,fsdp2:sr/bf16/inside,fsdp2:adamw,cpu_adam:sr/bf16/share=1/bucket=25,\
fsdp2:sr/8bit/inside/behind,fsdp2:fp32/bf16/inside/behind
stage cap80 170 "${bench[@]}" --warmup 2 --steps 3 --timeout 55 "${big[@]}" --batch 4 --memory-cap-gib 80 \
  --json "$WORK/cap80.json" --contenders cpu_adam:sr/bf16/share=auto/bucket=25,fsdp2:sr/bf16/inside/behind,torchao
stage cap24 60 "${bench[@]}" --warmup 2 --steps 2 --timeout 55 "${big[@]}" --batch 1 --memory-cap-gib 24 \
  --build-on-host --json "$WORK/cap24.json" --contenders fsdp2:sr/bf16/inside/behind
stage cap24_11B 110 "${bench[@]}" --warmup 1 --steps 2 --timeout 105 --layers 36 --dim 5120 --heads 40 --batch 1 \
  --memory-cap-gib 24 --build-on-host --json "$WORK/cap24_11B.json" --contenders fsdp2:sr/bf16/inside/behind
stage tests 40 python3 -m pytest -q $xdist -p no:cacheprovider tests/test_fsdp2_behind_cuda.py \
  tests/test_device_kernel.py tests/test_offload_cuda.py tests/test_offload_8bit.py tests/test_offload_overlap.py \
  tests/test_device_share.py tests/test_share_moves.py -k cuda
{ cat "$WORK/machine.txt"; for log in "$WORK"/*.log; do echo "== $log"; tail -n 30 "$log"; done; } > "$OUT/summary.txt"
tar czf "$OUT/gpu_check.tgz" -C /tmp gpu_check
cat "$OUT/summary.txt"
